package scheduler

import "testing"

// Hosts with the same labels and images share one copy of each; a copy
// goes when its last host does, and a host's labels read as its own.
func TestIndexSharesLabelsAndImages(t *testing.T) {
	ix := NewIndex(DefaultWeights())
	r := Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192}
	ix.Upsert(Host{Name: "a", Alive: true, Schedulable: true, Total: r, Images: []string{"sim"}, Labels: map[string]string{"rack": "r1"}})
	ix.Upsert(Host{Name: "b", Alive: true, Schedulable: true, Total: r, Images: []string{"sim"}, Labels: map[string]string{"rack": "r1"}})
	ix.Upsert(Host{Name: "c", Alive: true, Schedulable: true, Total: r, Images: []string{"sim", "deb"}, Labels: map[string]string{"rack": "r2"}})
	if len(ix.shared) != 4 {
		t.Fatalf("%d shared values for 2 label sets and 2 image lists; want 4", len(ix.shared))
	}
	if c, _ := ix.Get("c"); c.Labels["rack"] != "r2" || len(c.Images) != 2 {
		t.Fatalf("host c reads labels %v, images %v", c.Labels, c.Images)
	}
	// c takes a's labels: r2's copy goes.
	ix.Upsert(Host{Name: "c", Alive: true, Schedulable: true, Total: r, Images: []string{"sim"}, Labels: map[string]string{"rack": "r1"}})
	if len(ix.shared) != 2 {
		t.Fatalf("%d shared values after c moved to rack r1 and image sim; want 2", len(ix.shared))
	}
	for _, n := range []string{"a", "b", "c"} {
		ix.Remove(n)
	}
	if len(ix.shared) != 0 {
		t.Fatalf("%d shared values left after every host went", len(ix.shared))
	}
}
