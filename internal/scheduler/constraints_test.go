package scheduler

import (
	"fmt"
	"testing"
)

// rackHosts are six equal hosts, two per rack a, b, c.
func rackHosts() []Host {
	var hs []Host
	for i, rack := range []string{"a", "a", "b", "b", "c", "c"} {
		hs = append(hs, Host{Name: fmt.Sprintf("h%d", i+1), Alive: true, Schedulable: true, Images: []string{"img"},
			Total: Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 512000}, Labels: map[string]string{"rack": rack, "ssd": "yes"}})
	}
	hs[5].Labels = map[string]string{"rack": "c"} // no ssd
	return hs
}

func TestRejectConstraints(t *testing.T) {
	h := rackHosts()[0]
	small := Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024}
	noRack := h
	noRack.Labels = map[string]string{"ssd": "yes"}
	tests := []struct {
		name   string
		host   Host
		c      Constraints
		reason string
		detail string
	}{
		{"no constraints", h, Constraints{}, "", ""},
		{"labels match", h, Constraints{HostLabels: map[string]string{"rack": "a", "ssd": "yes"}}, "", ""},
		{"label differs", h, Constraints{HostLabels: map[string]string{"rack": "b"}}, ReasonLabels, "labels: needs rack=b, has rack=a"},
		{"label missing", noRack, Constraints{HostLabels: map[string]string{"rack": "a"}}, ReasonLabels, "labels: needs rack=a, has no label rack"},
		{"first mismatch in key order", h, Constraints{HostLabels: map[string]string{"zone": "1", "gpu": "x"}}, ReasonLabels, "labels: needs gpu=x, has no label gpu"},
		{"spread label missing", noRack, Constraints{Group: "g", SpreadBy: "label:rack"}, ReasonLabels, `labels: has no label rack to spread group "g" by`},
		{"under the cap", h, Constraints{Group: "g", SpreadBy: "host", MaxPerDomain: 2, Counts: map[string]int{"h1": 1}}, "", ""},
		{"at the host cap", h, Constraints{Group: "g", SpreadBy: "host", MaxPerDomain: 1, Counts: map[string]int{"h1": 1}}, ReasonGroupCap, `group_cap: group "g" has 1 of at most 1 VMs in host h1`},
		{"at the rack cap", h, Constraints{Group: "g", SpreadBy: "label:rack", MaxPerDomain: 2, Counts: map[string]int{"a": 2}}, ReasonGroupCap, `group_cap: group "g" has 2 of at most 2 VMs in domain rack=a`},
		{"no cap: counts only score", h, Constraints{Group: "g", SpreadBy: "host", Counts: map[string]int{"h1": 50}}, "", ""},
		{"other group's count elsewhere", h, Constraints{Group: "g", SpreadBy: "host", MaxPerDomain: 1, Counts: map[string]int{"h2": 1}}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Reject(tt.host, Request{Image: "img", Resources: small, Constraints: tt.c})
			if got.Reason != tt.reason || got.Detail != tt.detail {
				t.Errorf("Reject = %q (%q), want %q (%q)", got.Reason, got.Detail, tt.reason, tt.detail)
			}
		})
	}
}

func TestValidateSpreadBy(t *testing.T) {
	for in, ok := range map[string]bool{"host": true, "label:rack": true, "label:": false, "label: rack": false,
		"rack": false, "Host": false, "": false, "label:a b": true} {
		if err := ValidateSpreadBy(in); (err == nil) != ok {
			t.Errorf("ValidateSpreadBy(%q) = %v, want ok=%v", in, err, ok)
		}
	}
}

// place runs n placements of one group through Rank, feeding each choice
// back as the next one's facts (allocation and group counts), as the
// control plane does.
func place(t *testing.T, hosts []Host, c Constraints, n int) ([]string, Result) {
	t.Helper()
	c.Counts = map[string]int{}
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}, Constraints: c}
	var got []string
	for range n {
		res := Rank(DefaultWeights(), hosts, req)
		best, ok := res.Best()
		if !ok {
			return got, res
		}
		got = append(got, best.Host)
		for i := range hosts {
			if hosts[i].Name == best.Host {
				hosts[i].Allocated = hosts[i].Allocated.Add(req.Resources)
				d, _ := c.Domain(hosts[i])
				c.Counts[d]++
			}
		}
		req.Constraints = c
	}
	return got, Result{}
}

func TestSpreadByLabelLandsEvenly(t *testing.T) {
	hosts := rackHosts()
	got, _ := place(t, hosts, Constraints{Group: "web", SpreadBy: "label:rack"}, 12)
	perRack := map[string]int{}
	perHost := map[string]int{}
	for _, name := range got {
		perHost[name]++
		for _, h := range hosts {
			if h.Name == name {
				perRack[h.Labels["rack"]]++
			}
		}
	}
	if perRack["a"] != 4 || perRack["b"] != 4 || perRack["c"] != 4 {
		t.Errorf("12 VMs spread by rack landed %v, want 4/4/4", perRack)
	}
	// Within a rack the resource score spreads too: 2 per host.
	for name, n := range perHost {
		if n != 2 {
			t.Errorf("host %s took %d VMs, want 2 (%v)", name, n, perHost)
		}
	}
	// Deterministic: the same inputs give the same sequence.
	again, _ := place(t, rackHosts(), Constraints{Group: "web", SpreadBy: "label:rack"}, 12)
	if fmt.Sprint(again) != fmt.Sprint(got) {
		t.Errorf("placement not deterministic: %v then %v", got, again)
	}
	if got[0] != "h1" || got[1] != "h3" || got[2] != "h5" {
		t.Errorf("first three = %v, want h1 h3 h5 (ties go to the first name, one per rack)", got[:3])
	}
}

func TestMaxPerDomainIsAHardCap(t *testing.T) {
	got, res := place(t, rackHosts(), Constraints{Group: "db", SpreadBy: "host", MaxPerDomain: 1}, 7)
	if len(got) != 6 {
		t.Fatalf("placed %d (%v), want 6 then none", len(got), got)
	}
	seen := map[string]bool{}
	for _, h := range got {
		if seen[h] {
			t.Errorf("host %s took two VMs of the group: %v", h, got)
		}
		seen[h] = true
	}
	if len(res.Rejected) != 6 {
		t.Fatalf("rejected = %+v, want all 6 hosts", res.Rejected)
	}
	for _, r := range res.Rejected {
		if r.Reason != ReasonGroupCap {
			t.Errorf("host %s rejected for %q (%s), want group_cap", r.Host, r.Reason, r.Detail)
		}
	}
}

func TestHostLabelsFilterAndCapsTogether(t *testing.T) {
	got, res := place(t, rackHosts(), Constraints{HostLabels: map[string]string{"ssd": "yes"}, Group: "g", SpreadBy: "label:rack", MaxPerDomain: 1}, 4)
	if fmt.Sprint(got) != "[h1 h3 h5]" {
		t.Errorf("placed %v, want one per rack on ssd hosts [h1 h3 h5]", got)
	}
	reasons := map[string]string{}
	for _, r := range res.Rejected {
		reasons[r.Host] = r.Reason
	}
	want := map[string]string{"h1": ReasonGroupCap, "h2": ReasonGroupCap, "h3": ReasonGroupCap, "h4": ReasonGroupCap, "h5": ReasonGroupCap, "h6": ReasonLabels}
	if fmt.Sprint(reasons) != fmt.Sprint(want) {
		t.Errorf("reasons = %v, want %v", reasons, want)
	}
}

func TestSpreadTermInScore(t *testing.T) {
	hosts := rackHosts()[:2]
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024},
		Constraints: Constraints{Group: "g", SpreadBy: "host", Counts: map[string]int{"h1": 2}}}
	res := Rank(DefaultWeights(), hosts, req)
	if res.Ranked[0].Host != "h2" {
		t.Fatalf("best = %s, want h2 (h1 holds 2 of the group)", res.Ranked[0].Host)
	}
	h1 := res.Ranked[1]
	if h1.Terms.Spread != 2 || h1.Terms.Map()["spread"] != 2 {
		t.Errorf("spread term of h1 = %v, want 2 (weight 1 x 2 VMs)", h1.Terms.Spread)
	}
	if diff := h1.Score - res.Ranked[0].Score; diff < 1.99 || diff > 2.01 {
		t.Errorf("score difference = %v, want the spread term 2", diff)
	}
	if _, ok := res.Ranked[0].Terms.Map()["spread"]; ok {
		t.Error("a host with none of the group must show no spread term")
	}
}

// The candidate walk must reach a less crowded domain even when the least
// loaded hosts are all in a crowded one.
func TestCandidatesFindLeastCrowdedDomain(t *testing.T) {
	ix := NewIndex(DefaultWeights())
	for i := range 20 {
		ix.Upsert(Host{Name: fmt.Sprintf("a%02d", i), Alive: true, Schedulable: true, Images: []string{"img"},
			Total: Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 512000}, Labels: map[string]string{"rack": "a"}})
	}
	ix.Upsert(Host{Name: "b00", Alive: true, Schedulable: true, Images: []string{"img"},
		Total: Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 512000}, Allocated: Resources{MemoryMiB: 30000},
		Labels: map[string]string{"rack": "b"}})
	req := Request{Image: "img", Resources: Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024},
		Constraints: Constraints{Group: "g", SpreadBy: "label:rack", Counts: map[string]int{"a": 5}}}
	best, ok := ix.Candidates(req, 4).Best()
	if !ok || best.Host != "b00" {
		t.Errorf("best candidate = %+v, want b00 (rack b holds none of the group)", best)
	}
	req.Constraints.MaxPerDomain = 1
	req.Constraints.Counts = map[string]int{"a": 1, "b": 1}
	if _, ok := ix.Candidates(req, 4).Best(); ok {
		t.Error("every domain is at its cap: no candidate")
	}
}
