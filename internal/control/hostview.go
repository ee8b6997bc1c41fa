package control

import (
	"sync"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// hostView is this replica's cached picture of the hosts, indexed for
// placement. It may be a little stale: the database's conditional UPDATE
// decides every reservation, and a lost race refreshes the host. A
// placement "assumes" its reservation here before the database answers
// (as the Kubernetes scheduler cache does), so that concurrent placements
// in this replica spread over hosts instead of queueing on one row.
type hostView struct {
	mu    sync.Mutex
	w     scheduler.Weights
	limit int
	ix    *scheduler.Index
	// gen counts database refreshes per host; an assumption is undone only
	// if no refresh replaced it meanwhile.
	gen map[string]uint64
	// addr is each host's agent address; key its pinned identity key.
	addr map[string]string
	key  map[string]string
	// warm is each host's ready warm VMs per image and shape, from its
	// agent's last report; warmMargin is scheduler.PreferWarm's margin.
	warm       map[string]map[warmKey]int
	warmMargin float64
	// images is each host's image cache (registered images by sha256), from
	// its agent's last report (images.go); localMargin is
	// scheduler.PreferImageLocal's margin.
	images      map[string]map[string]agentapi.ImageStatus
	localMargin float64
}

func newHostView(w scheduler.Weights, limit int) *hostView {
	return &hostView{w: w, limit: limit, ix: scheduler.NewIndex(w), gen: map[string]uint64{}, addr: map[string]string{}, key: map[string]string{},
		warm: map[string]map[warmKey]int{}, warmMargin: scheduler.DefaultWarmMargin,
		images: map[string]map[string]agentapi.ImageStatus{}, localMargin: scheduler.DefaultImageMargin}
}

func schedHost(h store.Host) scheduler.Host {
	return scheduler.Host{
		Name: h.Name, Alive: h.Alive, Schedulable: h.Schedulable && h.Drain.State == store.DrainNone, Images: h.Images,
		Total:              schedResources(h.Total),
		CPUAllocationRatio: h.CPUAllocationRatio, MemoryReservedMiB: h.MemoryReservedMiB,
		Allocated: schedResources(h.Allocated), Labels: h.Labels, Underlay: h.UnderlayAddress != "",
	}
}

func schedResources(r store.Resources) scheduler.Resources {
	return scheduler.Resources{VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB}
}

func storeResources(r scheduler.Resources) store.Resources {
	return store.Resources{VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB}
}

func (v *hostView) load(hosts []store.Host) {
	ix := scheduler.NewIndex(v.w)
	for _, h := range hosts {
		ix.Upsert(schedHost(h))
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.ix = ix
	gen := make(map[string]uint64, len(hosts))
	addr := make(map[string]string, len(hosts))
	key := make(map[string]string, len(hosts))
	for _, h := range hosts {
		gen[h.Name] = v.gen[h.Name] + 1
		addr[h.Name], key[h.Name] = h.Address, h.AgentKey
	}
	v.gen, v.addr, v.key = gen, addr, key
}

func (v *hostView) upsert(h store.Host) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.upsertLocked(h)
}

func (v *hostView) upsertLocked(h store.Host) {
	v.ix.Upsert(schedHost(h))
	v.gen[h.Name]++
	v.addr[h.Name], v.key[h.Name] = h.Address, h.AgentKey
}

// apply refreshes the view with what changed in the database: the hosts
// written (as upsert does) and the hosts deleted, unless registered again
// (then they are among the written ones).
func (v *hostView) apply(changed []store.Host, deleted []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	again := make(map[string]bool, len(changed))
	for _, h := range changed {
		again[h.Name] = true
	}
	for _, name := range deleted {
		if !again[name] {
			v.removeLocked(name)
		}
	}
	for _, h := range changed {
		v.upsertLocked(h)
	}
}

func (v *hostView) remove(name string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.removeLocked(name)
}

func (v *hostView) removeLocked(name string) {
	v.ix.Remove(name)
	delete(v.gen, name)
	delete(v.addr, name)
	delete(v.key, name)
	delete(v.warm, name)
	delete(v.images, name)
}

// assumption is a reservation counted in the view before the database
// confirmed it.
type assumption struct {
	host string
	req  scheduler.Resources
	gen  uint64
}

// pick ranks up to limit candidates for req and assumes the best one.
func (v *hostView) pick(req scheduler.Request) (scheduler.Result, assumption, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	res, _ := v.preferWarmLocked(v.preferLocalLocked(v.ix.Candidates(req, v.limit), req), req)
	best, ok := res.Best()
	if !ok {
		return res, assumption{}, false
	}
	v.ix.Adjust(best.Host, req.Resources)
	v.takeWarmLocked(best.Host, req)
	return res, assumption{host: best.Host, req: req.Resources, gen: v.gen[best.Host]}, true
}

// assume counts a reservation on a given host (the slow path's choices).
func (v *hostView) assume(host string, r scheduler.Resources) assumption {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.ix.Adjust(host, r)
	return assumption{host: host, req: r, gen: v.gen[host]}
}

// undo takes back an assumption whose reservation failed.
func (v *hostView) undo(a assumption) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.gen[a.host] == a.gen {
		v.ix.Adjust(a.host, scheduler.Resources{}.Sub(a.req))
	}
}

// rankAll scores every host: dry runs and no_capacity explanations.
func (v *hostView) rankAll(req scheduler.Request) scheduler.Result {
	v.mu.Lock()
	hosts := v.ix.All()
	v.mu.Unlock()
	res := scheduler.Rank(v.w, hosts, req)
	v.mu.Lock()
	defer v.mu.Unlock()
	res, _ = v.preferWarmLocked(v.preferLocalLocked(res, req), req)
	return res
}

func (v *hostView) get(name string) (scheduler.Host, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.ix.Get(name)
}

// agent returns a host's agent address and whether the host is alive.
func (v *hostView) agent(name string) (address string, alive, known bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	h, ok := v.ix.Get(name)
	return v.addr[name], h.Alive, ok
}

// hostCapacity is a host's capacity as placement counts it (total less
// reserved memory, times the vCPU ratio), for the agent to keep its VMs
// and warm VMs within; nil when the host is unknown.
func (v *hostView) hostCapacity(name string) *agentapi.Resources {
	v.mu.Lock()
	defer v.mu.Unlock()
	h, ok := v.ix.Get(name)
	if !ok {
		return nil
	}
	c := h.Capacity()
	return &agentapi.Resources{VCPUs: c.VCPUs, MemoryMiB: c.MemoryMiB, DiskMiB: c.DiskMiB}
}

// agentKey is the identity key pinned for a host's agent ("" when none).
func (v *hostView) agentKey(name string) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.key[name]
}

func (v *hostView) hasImage(image string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.ix.HasImage(image)
}
