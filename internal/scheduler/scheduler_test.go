package scheduler

import (
	"fmt"
	"math"
	"slices"
	"testing"
)

func TestScoreVectors(t *testing.T) {
	total := Resources{VCPUs: 8, MemoryMiB: 65536, DiskMiB: 512000}
	req := Resources{VCPUs: 2, MemoryMiB: 4096, DiskMiB: 20480}
	tests := []struct {
		name  string
		total Resources
		free  Resources
		want  string
	}{
		{"empty host", total, Resources{VCPUs: 8, MemoryMiB: 65536, DiskMiB: 512000}, "1.07853"},
		{"half memory used", total, Resources{VCPUs: 8, MemoryMiB: 32768, DiskMiB: 512000}, "1.80468"},
		{"six vcpus used", total, Resources{VCPUs: 2, MemoryMiB: 65536, DiskMiB: 512000}, "11.04258"},
		{"disk total 0", Resources{VCPUs: 8, MemoryMiB: 65536, DiskMiB: 0}, Resources{VCPUs: 8, MemoryMiB: 65536, DiskMiB: 0}, "30.84686"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, terms := Score(DefaultWeights(), tt.total, tt.free, req)
			if s := fmt.Sprintf("%.5f", got); s != tt.want {
				t.Errorf("score = %s, want %s", s, tt.want)
			}
			if sum := terms.Memory + terms.Disk + terms.CPU + terms.Balance; math.Abs(sum-got) > 1e-12 {
				t.Errorf("terms add up to %v, score is %v", sum, got)
			}
		})
	}
}

func TestScoreWeightsAreConfigurable(t *testing.T) {
	total := Resources{VCPUs: 8, MemoryMiB: 65536, DiskMiB: 512000}
	req := Resources{VCPUs: 2, MemoryMiB: 4096, DiskMiB: 20480}
	w := Weights{Memory: 1, Saturation: 1.01}
	got, _ := Score(w, total, total, req)
	if want := 1 / (1.01 - 0.0625); math.Abs(got-want) > 1e-12 {
		t.Errorf("memory-only score = %v, want %v", got, want)
	}
}

func TestCapacityAppliesRatioAndReservedMemory(t *testing.T) {
	h := Host{Total: Resources{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 1000}, CPUAllocationRatio: 4, MemoryReservedMiB: 2048,
		Allocated: Resources{VCPUs: 30, MemoryMiB: 14000, DiskMiB: 100}}
	if got, want := h.Capacity(), (Resources{VCPUs: 32, MemoryMiB: 14336, DiskMiB: 1000}); got != want {
		t.Fatalf("capacity = %+v, want %+v", got, want)
	}
	if got, want := h.Free(), (Resources{VCPUs: 2, MemoryMiB: 336, DiskMiB: 900}); got != want {
		t.Fatalf("free = %+v, want %+v", got, want)
	}
	if got := (Host{Total: Resources{VCPUs: 4}}).Capacity().VCPUs; got != 4 {
		t.Errorf("ratio 0 must mean 1: vcpus capacity = %d", got)
	}
}

func TestRejectReasons(t *testing.T) {
	base := Host{Name: "h1", Alive: true, Schedulable: true, Images: []string{"busybox"},
		Total: Resources{VCPUs: 4, MemoryMiB: 8192, DiskMiB: 10000}, Allocated: Resources{VCPUs: 2, MemoryMiB: 6144, DiskMiB: 0}}
	req := Request{Image: "busybox", Resources: Resources{VCPUs: 1, MemoryMiB: 4096, DiskMiB: 100}}
	dead := base
	dead.Alive = false
	cordoned := base
	cordoned.Schedulable = false
	tests := []struct {
		name   string
		host   Host
		req    Request
		reason string
		want   string
	}{
		{"memory short", base, req, ReasonMemory, "memory: needs 4096 MiB, 2048 free"},
		{"all short", base, Request{Image: "busybox", Resources: Resources{VCPUs: 3, MemoryMiB: 4096, DiskMiB: 20000}},
			ReasonMemory, "memory: needs 4096 MiB, 2048 free; vcpus: needs 3, 2 free; disk: needs 20000 MiB, 10000 free"},
		{"cpu and disk short", base, Request{Image: "busybox", Resources: Resources{VCPUs: 3, DiskMiB: 20000}},
			ReasonCPU, "vcpus: needs 3, 2 free; disk: needs 20000 MiB, 10000 free"},
		{"disk short", base, Request{Image: "busybox", Resources: Resources{DiskMiB: 20000}},
			ReasonDisk, "disk: needs 20000 MiB, 10000 free"},
		{"fits", base, Request{Image: "busybox", Resources: Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 10000}}, "", ""},
		{"dead", dead, req, ReasonNotAlive, "not alive: the agent does not answer"},
		{"not schedulable", cordoned, req, ReasonUnschedulable, "not schedulable"},
		{"image", base, Request{Image: "debian", Resources: req.Resources}, ReasonNoImage, `image: does not offer "debian"`},
		{"pinned elsewhere", base, Request{Image: "busybox", Host: "h2"}, ReasonNotPinned, `not the pinned host "h2"`},
		{"network elsewhere", base, Request{Image: "busybox", NetworkHosts: []NetworkHosts{{Network: "lan", Hosts: []string{"h2", "h3"}}}},
			ReasonNetwork, `network: "lan" is not on this host (its hosts: h2, h3)`},
		{"network here", base, Request{Image: "busybox", NetworkHosts: []NetworkHosts{{Network: "lan", Hosts: []string{"h1"}}}}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Reject(tt.host, tt.req)
			if got.Reason != tt.reason || got.Detail != tt.want {
				t.Errorf("Reject = %q (%q), want %q (%q)", got.Reason, got.Detail, tt.reason, tt.want)
			}
			if tt.reason != "" && got.Host != tt.host.Name {
				t.Errorf("Reject names host %q, want %q", got.Host, tt.host.Name)
			}
		})
	}
}

func TestRankBreaksTiesByNameAndExplains(t *testing.T) {
	mk := func(name string, usedMem int64) Host {
		return Host{Name: name, Alive: true, Schedulable: true, Images: []string{"img"},
			Total: Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192}, Allocated: Resources{MemoryMiB: usedMem}}
	}
	hosts := []Host{mk("c", 0), mk("b", 0), mk("a", 4096), mk("full", 8192)}
	res := Rank(DefaultWeights(), hosts, Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}})
	var order []string
	for _, r := range res.Ranked {
		order = append(order, r.Host)
	}
	if want := []string{"b", "c", "a"}; !slices.Equal(order, want) {
		t.Errorf("ranking = %v, want %v (equal scores go to the first name)", order, want)
	}
	if len(res.Rejected) != 1 || res.Rejected[0] != (Rejection{Host: "full", Reason: ReasonMemory, Detail: "memory: needs 1024 MiB, 0 free"}) {
		t.Errorf("rejected = %+v", res.Rejected)
	}
}

// sequence is a tiny deterministic generator (splitmix64) for test fleets.
type sequence struct{ state uint64 }

func (s *sequence) next() uint64 {
	s.state += 0x9e3779b97f4a7c15
	z := s.state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// IntN returns a number in [0, n).
func (s *sequence) IntN(n int) int { return int(s.next() % uint64(n)) }

// Int64N returns a number in [0, n).
func (s *sequence) Int64N(n int64) int64 { return int64(s.next() % uint64(n)) }

// randomFleet builds a reproducible fleet of mixed sizes and loads.
func randomFleet(n int, seed uint64) []Host {
	r := &sequence{state: seed}
	hosts := make([]Host, n)
	for i := range hosts {
		total := Resources{VCPUs: int64(8 << r.IntN(3)), MemoryMiB: int64(16384 << r.IntN(3)), DiskMiB: int64(100000 << r.IntN(3))}
		hosts[i] = Host{
			Name: fmt.Sprintf("host-%05d", i), Alive: r.IntN(20) != 0, Schedulable: true, Images: []string{"img"},
			Total: total, CPUAllocationRatio: 1,
			Allocated: Resources{VCPUs: r.Int64N(total.VCPUs + 1), MemoryMiB: r.Int64N(total.MemoryMiB + 1), DiskMiB: r.Int64N(total.DiskMiB + 1)},
		}
	}
	return hosts
}

func TestIndexCandidatesMatchFullRankOnSmallFleets(t *testing.T) {
	req := Request{Image: "img", Resources: Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 10000}}
	for seed := range uint64(20) {
		hosts := randomFleet(40, seed)
		ix := NewIndex(DefaultWeights())
		for _, h := range hosts {
			ix.Upsert(h)
		}
		full := Rank(DefaultWeights(), hosts, req)
		got := ix.Candidates(req, 64)
		if !slices.EqualFunc(full.Ranked, got.Ranked, func(a, b Ranked) bool { return a.Host == b.Host && a.Score == b.Score }) {
			t.Fatalf("seed %d: with a limit above the fleet size Candidates must equal Rank:\n%v\n%v", seed, full.Ranked, got.Ranked)
		}
	}
}

func TestIndexCandidatesAreBoundedAndFollowLoad(t *testing.T) {
	hosts := randomFleet(2000, 7)
	ix := NewIndex(DefaultWeights())
	for _, h := range hosts {
		ix.Upsert(h)
	}
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1000}}
	got := ix.Candidates(req, 16)
	if len(got.Ranked) != 16 {
		t.Fatalf("got %d candidates, want 16", len(got.Ranked))
	}
	best, _ := Rank(DefaultWeights(), hosts, req).Best()
	if got.Ranked[0].Host != best.Host {
		t.Errorf("best candidate %s (%.5f), full scan best %s (%.5f)", got.Ranked[0].Host, got.Ranked[0].Score, best.Host, best.Score)
	}
}

func TestIndexAdjustReordersAndSpreads(t *testing.T) {
	ix := NewIndex(DefaultWeights())
	for i := range 3 {
		ix.Upsert(Host{Name: fmt.Sprintf("h%d", i), Alive: true, Schedulable: true, Images: []string{"img"},
			Total: Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 4096}})
	}
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}}
	var placed []string
	for range 12 {
		best, ok := ix.Candidates(req, 2).Best()
		if !ok {
			t.Fatalf("no candidate after %v", placed)
		}
		placed = append(placed, best.Host)
		ix.Adjust(best.Host, req.Resources)
	}
	want := []string{"h0", "h1", "h2", "h0", "h1", "h2", "h0", "h1", "h2", "h0", "h1", "h2"}
	if !slices.Equal(placed, want) {
		t.Errorf("placements = %v, want %v", placed, want)
	}
	if _, ok := ix.Candidates(req, 2).Best(); ok {
		t.Error("a full fleet must have no candidate")
	}
	ix.Adjust("h1", Resources{}.Sub(req.Resources))
	if best, _ := ix.Candidates(req, 2).Best(); best.Host != "h1" {
		t.Errorf("after a release on h1 the best host is %q", best.Host)
	}
}

func TestIndexSkipsDeadHostsAndTracksImages(t *testing.T) {
	ix := NewIndex(DefaultWeights())
	h := Host{Name: "h", Alive: true, Schedulable: true, Images: []string{"a"}, Total: Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 4096}}
	ix.Upsert(h)
	if !ix.HasImage("a") || ix.HasImage("b") {
		t.Fatal("image tracking wrong")
	}
	h.Alive = false
	ix.Upsert(h)
	if _, ok := ix.Candidates(Request{Image: "a"}, 4).Best(); ok {
		t.Error("a dead host must not be a candidate")
	}
	if got := ix.Candidates(Request{Image: "a", Host: "h"}, 4).Rejected; len(got) != 1 || got[0].Reason != ReasonNotAlive {
		t.Errorf("pinned to a dead host: %+v", got)
	}
	ix.Remove("h")
	if ix.HasImage("a") || ix.Len() != 0 {
		t.Error("remove must forget the host and its images")
	}
}

// A request with volumes goes to their host alone, even when others score
// better; the others are rejected for "volume", and the same host full is
// a disk rejection.
func TestVolumeHostIsAHardFilter(t *testing.T) {
	hosts := randomFleet(200, 3)
	ix := NewIndex(DefaultWeights())
	for _, h := range hosts {
		ix.Upsert(h)
	}
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 256, DiskMiB: 100}}
	best, ok := Rank(DefaultWeights(), hosts, req).Best()
	if !ok {
		t.Fatal("the fleet takes nothing")
	}
	full := Rank(DefaultWeights(), hosts, req)
	target := full.Ranked[len(full.Ranked)-1].Host // the worst that fits
	if target == best.Host {
		t.Fatal("need two feasible hosts")
	}
	req.VolumeHost = target
	for _, res := range []Result{ix.Candidates(req, 16), Rank(DefaultWeights(), hosts, req)} {
		got, ok := res.Best()
		if !ok || got.Host != target || len(res.Ranked) != 1 {
			t.Fatalf("volume host %s: ranked %v", target, res.Ranked)
		}
		for _, r := range res.Rejected {
			if r.Host != target && r.Reason != ReasonVolume {
				t.Errorf("host %s rejected for %q, want %q", r.Host, r.Reason, ReasonVolume)
			}
		}
	}
	if n := len(ix.Candidates(req, 16).Rejected); n != 16 {
		t.Errorf("Candidates explains %d rejections, want its limit 16", n)
	}
	req.Resources.DiskMiB = 1 << 40
	if r := Reject(Host{Name: target, Alive: true, Schedulable: true, Images: []string{"img"}, Total: Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10}}, req); r.Reason != ReasonDisk {
		t.Errorf("the volume host without room: reason %q, want %q", r.Reason, ReasonDisk)
	}
}
