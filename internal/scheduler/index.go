package scheduler

import (
	"cmp"
	"hash/fnv"
	"maps"
	"slices"
	"strings"
)

// Index keeps hosts ordered by pressure, the score a host has right now
// (the score of an empty request), so that placement scores only a bounded
// number of the least loaded feasible hosts instead of every host.
//
// Why: scoring every host on every placement costs O(hosts), which does not
// reach thousands of placements per second at 10,000 hosts. Like Nomad's
// candidate limit and Kubernetes' percentageOfNodesToScore, Candidates walks
// hosts from the least loaded, skips the ones that do not fit, and stops
// after `limit` feasible ones; those are scored exactly. Because pressure is
// the same formula as the score without the request, the best host is among
// the first candidates in all but contrived fleets. Walking and updating the
// order cost O(log hosts) per host visited. Hosts that are dead or not
// schedulable are kept out of the order but remain known for explanations.
//
// Index is not safe for concurrent use; the caller holds a lock.
type Index struct {
	weights Weights
	hosts   map[string]*indexEntry
	root    *treapNode
	images  map[string]int // image -> number of hosts offering it
	// labels counts hosts per label key and value: the spread domains.
	labels map[string]map[string]int
	// shared holds one copy of each set of labels and each list of images
	// that hosts have, with how many hosts use it: a fleet's hosts share a
	// few of them (a rack, a zone, an image list), and a map per host was
	// the largest part of the index's memory at 100,000 hosts. What it
	// holds is never written.
	shared map[string]*sharedValue
}

type sharedValue struct {
	labels map[string]string
	images []string
	hosts  int
}

type indexEntry struct {
	host   Host
	node   *treapNode // nil when the host is not in the order
	images []string
}

// NewIndex returns an empty index that orders hosts with these weights.
func NewIndex(w Weights) *Index {
	return &Index{weights: w, hosts: map[string]*indexEntry{}, images: map[string]int{}, labels: map[string]map[string]int{},
		shared: map[string]*sharedValue{}}
}

// Len is the number of hosts known.
func (ix *Index) Len() int { return len(ix.hosts) }

// Get returns a host by name.
func (ix *Index) Get(name string) (Host, bool) {
	e, ok := ix.hosts[name]
	if !ok {
		return Host{}, false
	}
	return e.host, true
}

// HasImage says whether any known host offers the image.
func (ix *Index) HasImage(image string) bool { return ix.images[image] > 0 }

// Upsert adds a host or replaces what is known about it.
func (ix *Index) Upsert(h Host) {
	ix.Remove(h.Name)
	h.Images = ix.share(imagesKey(h.Images), func() *sharedValue { return &sharedValue{images: slices.Clone(h.Images)} }).images
	h.Labels = ix.share(labelsKey(h.Labels), func() *sharedValue { return &sharedValue{labels: maps.Clone(h.Labels)} }).labels
	e := &indexEntry{host: h, images: h.Images}
	for _, img := range h.Images {
		ix.images[img]++
	}
	for k, v := range h.Labels {
		if ix.labels[k] == nil {
			ix.labels[k] = map[string]int{}
		}
		ix.labels[k][v]++
	}
	ix.hosts[h.Name] = e
	ix.order(e)
}

// Remove forgets a host.
func (ix *Index) Remove(name string) {
	e, ok := ix.hosts[name]
	if !ok {
		return
	}
	ix.unorder(e)
	for _, img := range e.images {
		if ix.images[img]--; ix.images[img] <= 0 {
			delete(ix.images, img)
		}
	}
	for k, v := range e.host.Labels {
		if ix.labels[k][v]--; ix.labels[k][v] <= 0 {
			delete(ix.labels[k], v)
		}
		if len(ix.labels[k]) == 0 {
			delete(ix.labels, k)
		}
	}
	ix.unshare(imagesKey(e.host.Images))
	ix.unshare(labelsKey(e.host.Labels))
	delete(ix.hosts, name)
}

// share returns the shared copy under key, made by fresh if there is none,
// and counts one more host using it.
func (ix *Index) share(key string, fresh func() *sharedValue) *sharedValue {
	v, ok := ix.shared[key]
	if !ok {
		v = fresh()
		ix.shared[key] = v
	}
	v.hosts++
	return v
}

func (ix *Index) unshare(key string) {
	if v, ok := ix.shared[key]; ok {
		if v.hosts--; v.hosts <= 0 {
			delete(ix.shared, key)
		}
	}
}

// imagesKey and labelsKey name a list of images and a set of labels in
// shared; the first byte keeps the two kinds apart.
func imagesKey(images []string) string {
	return "i" + strings.Join(images, "\x00")
}

func labelsKey(labels map[string]string) string {
	var b strings.Builder
	b.WriteByte('l')
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		b.WriteString(k)
		b.WriteByte(0)
		b.WriteString(labels[k])
		b.WriteByte(0)
	}
	return b.String()
}

// Adjust adds delta to a host's allocation (negative to release) and moves
// it in the order. Unknown hosts are ignored.
func (ix *Index) Adjust(name string, delta Resources) {
	e, ok := ix.hosts[name]
	if !ok {
		return
	}
	ix.unorder(e)
	e.host.Allocated = e.host.Allocated.Add(delta)
	ix.order(e)
}

// All returns every known host, sorted by name.
func (ix *Index) All() []Host {
	out := make([]Host, 0, len(ix.hosts))
	for _, e := range ix.hosts {
		out = append(out, e.host)
	}
	slices.SortFunc(out, func(a, b Host) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Candidates returns up to limit feasible hosts for req, scored and ranked,
// found by walking hosts from the least loaded. Rejected lists at most
// limit of the hosts skipped on the way; use Rank over All for the full
// explanation. With a group, the walk keeps the hosts of the least crowded
// domain level only, and goes on until it has limit of them in the least
// crowded domain that exists (or reached the end): the spread term ranks a
// host of a more crowded domain behind them unless it is much less loaded.
func (ix *Index) Candidates(req Request, limit int) Result {
	var res Result
	// A pinned host, or the host of the VM's volumes, is the only
	// candidate: no walk.
	if only := cmp.Or(req.Host, req.VolumeHost); only != "" {
		e, ok := ix.hosts[only]
		if !ok {
			res.Rejected = []Rejection{{Host: only, Reason: ReasonNotRegistered, Detail: "not registered"}}
			return res
		}
		res = Rank(ix.weights, []Host{e.host}, req)
		if req.Host == "" {
			// The explanation names up to limit of the hosts the volumes
			// ruled out, the least loaded first (a walk that stops there).
			ix.root.walk(func(n *treapNode) bool {
				if h := n.entry.host; h.Name != only {
					res.Rejected = append(res.Rejected, Reject(h, req))
				}
				return len(res.Rejected) < limit
			})
		}
		return res
	}
	c := req.Constraints
	least, floor := -1, 0
	if c.Group != "" {
		floor = ix.leastCount(c)
	}
	ix.root.walk(func(n *treapNode) bool {
		h := n.entry.host
		if r := Reject(h, req); r.Reason != "" {
			if len(res.Rejected) < limit {
				res.Rejected = append(res.Rejected, r)
			}
			return true
		}
		if c.Group != "" {
			domain, _ := c.Domain(h)
			switch count := c.Counts[domain]; {
			case least >= 0 && count > least:
				return true
			case count < least || least < 0:
				least, res.Ranked = count, res.Ranked[:0]
			}
		}
		res.Ranked = append(res.Ranked, score(ix.weights, h, req))
		return len(res.Ranked) < limit || least > floor
	})
	sortRanked(res.Ranked)
	return res
}

// leastCount is the fewest VMs of c's group that any existing domain
// holds: the level a walk can stop at.
func (ix *Index) leastCount(c Constraints) int {
	key := c.SpreadLabel()
	if key == "" {
		if len(c.Counts) < len(ix.hosts) {
			return 0
		}
		least := -1
		for name := range ix.hosts {
			if n := c.Counts[name]; least < 0 || n < least {
				least = n
			}
		}
		return max(least, 0)
	}
	least := -1
	for v := range ix.labels[key] {
		if n := c.Counts[v]; least < 0 || n < least {
			least = n
		}
	}
	return max(least, 0)
}

func (ix *Index) order(e *indexEntry) {
	if !e.host.Alive || !e.host.Schedulable {
		return
	}
	pressure, _ := Score(ix.weights, e.host.Capacity(), e.host.Free(), Resources{})
	e.node = &treapNode{pressure: pressure, name: e.host.Name, prio: priority(e.host.Name), entry: e}
	ix.root = ix.root.insert(e.node)
}

func (ix *Index) unorder(e *indexEntry) {
	if e.node == nil {
		return
	}
	ix.root = ix.root.remove(e.node)
	e.node = nil
}

// treapNode is a node of a treap ordered by (pressure, name). Priorities
// come from a hash of the name, so the shape is balanced in expectation and
// yet fully deterministic.
type treapNode struct {
	pressure    float64
	name        string
	prio        uint64
	entry       *indexEntry
	left, right *treapNode
}

func (n *treapNode) before(o *treapNode) bool {
	if n.pressure != o.pressure {
		return n.pressure < o.pressure
	}
	return n.name < o.name
}

func (n *treapNode) insert(x *treapNode) *treapNode {
	if n == nil {
		return x
	}
	if x.prio > n.prio {
		x.left, x.right = n.split(x)
		return x
	}
	if x.before(n) {
		n.left = n.left.insert(x)
	} else {
		n.right = n.right.insert(x)
	}
	return n
}

// split returns the nodes ordered before k and the others.
func (n *treapNode) split(k *treapNode) (*treapNode, *treapNode) {
	if n == nil {
		return nil, nil
	}
	if n.before(k) {
		l, r := n.right.split(k)
		n.right = l
		return n, r
	}
	l, r := n.left.split(k)
	n.left = r
	return l, n
}

func (n *treapNode) remove(x *treapNode) *treapNode {
	if n == nil {
		return nil
	}
	if n == x {
		return merge(n.left, n.right)
	}
	if x.before(n) {
		n.left = n.left.remove(x)
	} else {
		n.right = n.right.remove(x)
	}
	return n
}

// merge joins two treaps where every node of l is ordered before r.
func merge(l, r *treapNode) *treapNode {
	if l == nil {
		return r
	}
	if r == nil {
		return l
	}
	if l.prio > r.prio {
		l.right = merge(l.right, r)
		return l
	}
	r.left = merge(l, r.left)
	return r
}

// walk visits nodes in order until fn returns false; it reports whether
// the walk went to the end.
func (n *treapNode) walk(fn func(*treapNode) bool) bool {
	if n == nil {
		return true
	}
	return n.left.walk(fn) && fn(n) && n.right.walk(fn)
}

func priority(name string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(name))
	// splitmix64 finaliser: spreads similar names (host-0001, host-0002).
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
