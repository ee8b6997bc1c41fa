// Package scheduler is pure placement: the hard filters, the score of
// DESIGN.md section 5 and the explanation of a choice. It has no I/O, no
// clock and no randomness, so every decision is reproducible from its inputs.
package scheduler

import (
	"fmt"
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
	// NetworkHosts are the VM's networks that exist on some hosts only.
	NetworkHosts []NetworkHosts
	// ColdOnly says that no warm pool VM can serve the request (its NICs
	// differ from what pool VMs boot with), so warm VMs give no preference.
	ColdOnly bool
}

// NetworkHosts limits a request to the hosts a network is on.
type NetworkHosts struct {
	Network string
	Hosts   []string
}

// Rejection says why one host cannot take a request.
type Rejection struct {
	Host   string
	Reason string
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

// Reject returns why h cannot take req, or "" when it can. Every resource
// shortfall is listed so an operator sees the whole picture at once.
func Reject(h Host, req Request) string {
	if req.Host != "" && req.Host != h.Name {
		return fmt.Sprintf("not the pinned host %q", req.Host)
	}
	if !h.Alive {
		return "not alive: the agent does not answer"
	}
	if !h.Schedulable {
		return "not schedulable"
	}
	if req.Image != "" && !h.HasImage(req.Image) {
		return fmt.Sprintf("image: does not offer %q", req.Image)
	}
	for _, n := range req.NetworkHosts {
		if !slices.Contains(n.Hosts, h.Name) {
			return fmt.Sprintf("network: %q is not on this host (its hosts: %s)", n.Network, strings.Join(n.Hosts, ", "))
		}
	}
	free := h.Free()
	var short []string
	if req.Resources.MemoryMiB > free.MemoryMiB {
		short = append(short, fmt.Sprintf("memory: needs %d MiB, %d free", req.Resources.MemoryMiB, max(free.MemoryMiB, 0)))
	}
	if req.Resources.VCPUs > free.VCPUs {
		short = append(short, fmt.Sprintf("vcpus: needs %d, %d free", req.Resources.VCPUs, max(free.VCPUs, 0)))
	}
	if req.Resources.DiskMiB > free.DiskMiB {
		short = append(short, fmt.Sprintf("disk: needs %d MiB, %d free", req.Resources.DiskMiB, max(free.DiskMiB, 0)))
	}
	return strings.Join(short, "; ")
}

// Rank filters and scores every host. It is the full scan behind dry runs
// and no_capacity explanations; placement uses Index.Candidates instead.
func Rank(w Weights, hosts []Host, req Request) Result {
	var res Result
	for _, h := range hosts {
		if reason := Reject(h, req); reason != "" {
			res.Rejected = append(res.Rejected, Rejection{Host: h.Name, Reason: reason})
			continue
		}
		s, terms := Score(w, h.Capacity(), h.Free(), req.Resources)
		res.Ranked = append(res.Ranked, Ranked{Host: h.Name, Score: s, Terms: terms})
	}
	sortRanked(res.Ranked)
	slices.SortFunc(res.Rejected, func(a, b Rejection) int { return strings.Compare(a.Host, b.Host) })
	return res
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
