// Package scheduler is pure placement: the hard filters, the score of
// docs/guides/architecture.md and the explanation of a choice. It has no I/O, no
// clock and no randomness, so every decision is reproducible from its inputs.
package scheduler

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Resources is an amount of capacity: whole vCPUs, memory and disk in MiB.
type Resources struct {
	VCPUs     int64
	MemoryMiB int64
	DiskMiB   int64
}

// Add returns r + o.
func (r Resources) Add(o Resources) Resources {
	return Resources{r.VCPUs + o.VCPUs, r.MemoryMiB + o.MemoryMiB, r.DiskMiB + o.DiskMiB}
}

// Sub returns r - o.
func (r Resources) Sub(o Resources) Resources {
	return Resources{r.VCPUs - o.VCPUs, r.MemoryMiB - o.MemoryMiB, r.DiskMiB - o.DiskMiB}
}

// Host is what the scheduler knows about one host.
type Host struct {
	Name        string
	Alive       bool
	Schedulable bool
	Images      []string
	// Total is the physical capacity the agent reports.
	Total Resources
	// CPUAllocationRatio overcommits vCPUs (1 = none); 0 means 1.
	CPUAllocationRatio float64
	// MemoryReservedMiB is kept back for the host itself.
	MemoryReservedMiB int64
	// Allocated is the sum of the VMs placed on the host.
	Allocated Resources
	// Labels are the host's labels: constraints filter and spread by them.
	Labels map[string]string
	// Underlay says that the host has an underlay address, which overlay
	// networks' tunnels need.
	Underlay bool
}

// Capacity is what VMs may use: (total - reserved) x allocation ratio.
// The ratio applies to vCPUs only; memory and disk are never overcommitted.
func (h Host) Capacity() Resources {
	return Capacity(h.Total, h.CPUAllocationRatio, h.MemoryReservedMiB)
}

// Free is capacity minus allocation (negative when a host shrank under its VMs).
func (h Host) Free() Resources { return h.Capacity().Sub(h.Allocated) }

// HasImage says whether the host offers the image.
func (h Host) HasImage(image string) bool { return slices.Contains(h.Images, image) }

// Capacity computes the usable capacity from the physical totals.
func Capacity(total Resources, cpuRatio float64, memoryReservedMiB int64) Resources {
	if cpuRatio <= 0 {
		cpuRatio = 1
	}
	mem := total.MemoryMiB - memoryReservedMiB
	if mem < 0 {
		mem = 0
	}
	return Resources{
		VCPUs:     int64(float64(total.VCPUs) * cpuRatio),
		MemoryMiB: mem,
		DiskMiB:   total.DiskMiB,
	}
}

// Request is the shape of a VM to place. Host, when set, pins the VM to that host.
type Request struct {
	Image     string
	Resources Resources
	Host      string
	// ImageSHA256 is set for a registered image: every host can fetch it,
	// so the "host offers the image" filter (no_image) does not apply, and
	// hosts that hold it already are preferred (PreferImageLocal).
	ImageSHA256 string
	// Constraints steer placement; the zero value places by score alone.
	Constraints Constraints
	// NetworkHosts are the VM's networks that exist on some hosts only,
	// and its overlay networks (on hosts with an underlay address only).
	NetworkHosts []NetworkHosts
	// ColdOnly says that no warm pool VM can serve the request (its NICs
	// differ from what pool VMs boot with), so warm VMs give no preference.
	ColdOnly bool
	// VolumeHost is the host of the volumes the VM attaches ("" for
	// none): every other host is rejected (ReasonVolume).
	VolumeHost string
	// Source is the host a migrating VM leaves ("" for a create): it is
	// rejected (ReasonSource). The caller counts the VM out of its group's
	// domain there (Constraints.Counts), since it leaves it.
	Source string
}

// NetworkHosts limits a request to the hosts a network is on: Hosts when
// not empty, and hosts with an underlay address when Overlay.
type NetworkHosts struct {
	Network string
	Hosts   []string
	Overlay bool
}

// Reasons a host is rejected: named, stable, and counted by the control
// API's metrics. Detail says the particulars to a person.
const (
	ReasonNotPinned     = "not_pinned"
	ReasonNotRegistered = "not_registered"
	ReasonNotAlive      = "not_alive"
	ReasonUnschedulable = "unschedulable"
	ReasonNoImage       = "no_image"
	ReasonNetwork       = "network"
	ReasonLabels        = "labels"
	ReasonGroupCap      = "group_cap"
	ReasonMemory        = "memory"
	ReasonCPU           = "cpu"
	ReasonDisk          = "disk"
	ReasonVolume        = "volume"
	ReasonSource        = "source"
)

// Reasons lists every rejection reason, in the order the filters apply.
func Reasons() []string {
	return []string{ReasonNotPinned, ReasonSource, ReasonVolume, ReasonNotRegistered, ReasonNotAlive, ReasonUnschedulable, ReasonNoImage,
		ReasonNetwork, ReasonLabels, ReasonGroupCap, ReasonMemory, ReasonCPU, ReasonDisk}
}

// Rejection says why one host cannot take a request: Reason is one of the
// Reason constants (the first filter that failed), Detail the particulars.
type Rejection struct {
	Host   string
	Reason string
	Detail string
}

// Ranked is a host that fits, with its score (lower is better) and the terms
// that add up to it.
type Ranked struct {
	Host  string
	Score float64
	Terms Terms
	// WarmReady is how many warm VMs of the request's image and shape the
	// host has ready (set by PreferWarm), and WarmPreferred says that the
	// warm preference put this host first over a better score.
	WarmReady     int
	WarmPreferred bool
	// ImageLocal says that the host holds the request's registered image
	// (set by PreferImageLocal), and ImagePreferred that this put the host
	// first over a better score.
	ImageLocal     bool
	ImagePreferred bool
}

// Result is a ranking: the hosts that fit, best first, and the rejected ones.
type Result struct {
	Ranked   []Ranked
	Rejected []Rejection
}

// Best returns the best host, if any fits.
func (r Result) Best() (Ranked, bool) {
	if len(r.Ranked) == 0 {
		return Ranked{}, false
	}
	return r.Ranked[0], true
}

// Reject returns why h cannot take req, or the zero Rejection when it can.
// Filters apply in the order of Reasons; among resources every shortfall is
// listed in Detail so an operator sees the whole picture at once, and
// Reason names the first (memory, then cpu, then disk).
func Reject(h Host, req Request) Rejection {
	reject := func(reason, format string, a ...any) Rejection {
		return Rejection{Host: h.Name, Reason: reason, Detail: fmt.Sprintf(format, a...)}
	}
	if req.Host != "" && req.Host != h.Name {
		return reject(ReasonNotPinned, "not the pinned host %q", req.Host)
	}
	if req.Source != "" && req.Source == h.Name {
		return reject(ReasonSource, "source: the VM runs on this host now")
	}
	if req.VolumeHost != "" && req.VolumeHost != h.Name {
		return reject(ReasonVolume, "volume: the VM's volumes are on host %q", req.VolumeHost)
	}
	if !h.Alive {
		return reject(ReasonNotAlive, "not alive: the agent does not answer")
	}
	if !h.Schedulable {
		return reject(ReasonUnschedulable, "not schedulable")
	}
	if req.Image != "" && req.ImageSHA256 == "" && !h.HasImage(req.Image) {
		return reject(ReasonNoImage, "image: does not offer %q", req.Image)
	}
	for _, n := range req.NetworkHosts {
		if n.Overlay && !h.Underlay {
			return reject(ReasonNetwork, "network: %q is an overlay network and this host has no underlay address; register its underlay_address (PUT /v1/hosts/%s)",
				n.Network, h.Name)
		}
		if len(n.Hosts) > 0 && !slices.Contains(n.Hosts, h.Name) {
			return reject(ReasonNetwork, "network: %q is not on this host (its hosts: %s)", n.Network, strings.Join(n.Hosts, ", "))
		}
	}
	c := req.Constraints
	if k, ok := mismatchedLabel(h.Labels, c.HostLabels); ok {
		got, has := h.Labels[k]
		if !has {
			return reject(ReasonLabels, "labels: needs %s=%s, has no label %s", k, c.HostLabels[k], k)
		}
		return reject(ReasonLabels, "labels: needs %s=%s, has %s=%s", k, c.HostLabels[k], k, got)
	}
	if c.Group != "" {
		domain, ok := c.Domain(h)
		if !ok {
			return reject(ReasonLabels, "labels: has no label %s to spread group %q by", c.SpreadLabel(), c.Group)
		}
		if n := c.Counts[domain]; c.MaxPerDomain > 0 && n >= c.MaxPerDomain {
			return reject(ReasonGroupCap, "group_cap: group %q has %d of at most %d VMs in %s", c.Group, n, c.MaxPerDomain, c.describeDomain(domain))
		}
	}
	free := h.Free()
	var short []string
	reason := ""
	add := func(r, text string) {
		if reason == "" {
			reason = r
		}
		short = append(short, text)
	}
	if req.Resources.MemoryMiB > free.MemoryMiB {
		add(ReasonMemory, fmt.Sprintf("memory: needs %d MiB, %d free", req.Resources.MemoryMiB, max(free.MemoryMiB, 0)))
	}
	if req.Resources.VCPUs > free.VCPUs {
		add(ReasonCPU, fmt.Sprintf("vcpus: needs %d, %d free", req.Resources.VCPUs, max(free.VCPUs, 0)))
	}
	if req.Resources.DiskMiB > free.DiskMiB {
		add(ReasonDisk, fmt.Sprintf("disk: needs %d MiB, %d free", req.Resources.DiskMiB, max(free.DiskMiB, 0)))
	}
	if reason == "" {
		return Rejection{}
	}
	return Rejection{Host: h.Name, Reason: reason, Detail: strings.Join(short, "; ")}
}

// mismatchedLabel returns the first key (in sorted order, so explanations
// are stable) of want that the host's labels do not match.
func mismatchedLabel(have, want map[string]string) (string, bool) {
	if len(want) == 0 {
		return "", false
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if v, ok := have[k]; !ok || v != want[k] {
			return k, true
		}
	}
	return "", false
}

// Rank filters and scores every host. It is the full scan behind dry runs
// and no_capacity explanations; placement uses Index.Candidates instead.
func Rank(w Weights, hosts []Host, req Request) Result {
	var res Result
	for _, h := range hosts {
		if r := Reject(h, req); r.Reason != "" {
			res.Rejected = append(res.Rejected, r)
			continue
		}
		res.Ranked = append(res.Ranked, score(w, h, req))
	}
	sortRanked(res.Ranked)
	slices.SortFunc(res.Rejected, func(a, b Rejection) int { return strings.Compare(a.Host, b.Host) })
	return res
}

// score rates a host that passed the filters: the resource score of
// docs/guides/placement.md plus, for a group, the spread term.
func score(w Weights, h Host, req Request) Ranked {
	s, terms := Score(w, h.Capacity(), h.Free(), req.Resources)
	if c := req.Constraints; c.Group != "" {
		domain, _ := c.Domain(h)
		terms.Spread = w.Spread * float64(c.Counts[domain])
		s += terms.Spread
	}
	return Ranked{Host: h.Name, Score: s, Terms: terms}
}

// sortRanked orders by score, then by name so that ties are deterministic.
func sortRanked(r []Ranked) {
	slices.SortFunc(r, func(a, b Ranked) int {
		switch {
		case a.Score < b.Score:
			return -1
		case a.Score > b.Score:
			return 1
		}
		return strings.Compare(a.Host, b.Host)
	})
}
