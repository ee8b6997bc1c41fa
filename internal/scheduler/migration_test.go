package scheduler

import "testing"

// A migration's request rejects the VM's own host (source) first, and the
// group's cap counts the VM out of the domain it leaves only through
// Counts, which the caller lowers.
func TestMigrationRejectsSourceAndKeepsCaps(t *testing.T) {
	host := func(name string) Host {
		return Host{Name: name, Alive: true, Schedulable: true, Images: []string{"img"},
			Total: Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000}}
	}
	hosts := []Host{host("h1"), host("h2"), host("h3")}
	req := Request{Image: "img", Source: "h1", Resources: Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 100},
		Constraints: Constraints{Group: "db", SpreadBy: SpreadByHost, MaxPerDomain: 1, Counts: map[string]int{"h1": 0, "h2": 1}}}
	res := Rank(DefaultWeights(), hosts, req)
	if best, ok := res.Best(); !ok || best.Host != "h3" || len(res.Ranked) != 1 {
		t.Fatalf("ranked %v; want h3 alone", res.Ranked)
	}
	want := map[string]string{"h1": ReasonSource, "h2": ReasonGroupCap}
	for _, r := range res.Rejected {
		if want[r.Host] != r.Reason {
			t.Errorf("host %s rejected for %q (%s); want %q", r.Host, r.Reason, r.Detail, want[r.Host])
		}
	}
	if len(res.Rejected) != 2 {
		t.Errorf("rejected %v; want h1 and h2", res.Rejected)
	}
	// Pinned to its own host: rejected as the source, not as not pinned.
	req.Host = "h1"
	if r := Reject(host("h1"), req); r.Reason != ReasonSource {
		t.Errorf("own host pinned: reason %q, want %q", r.Reason, ReasonSource)
	}
}
