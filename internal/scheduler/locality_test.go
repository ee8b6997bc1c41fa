package scheduler

import (
	"strings"
	"testing"
)

func TestPreferImageLocal(t *testing.T) {
	base := Result{Ranked: []Ranked{{Host: "a", Score: 1.0}, {Host: "b", Score: 1.05}, {Host: "c", Score: 1.5}}}
	cases := []struct {
		name      string
		holds     map[string]bool
		wantFirst string
		reordered bool
	}{
		{"nobody holds it", nil, "a", false},
		{"best holds it", map[string]bool{"a": true, "b": true}, "a", false},
		{"runner-up within margin holds it", map[string]bool{"b": true}, "b", true},
		{"only a host beyond the margin holds it", map[string]bool{"c": true}, "a", false},
		{"equal scores: the holder wins", map[string]bool{"b": true}, "b", true},
	}
	for _, c := range cases {
		in := base
		if c.name == "equal scores: the holder wins" {
			in = Result{Ranked: []Ranked{{Host: "a", Score: 1}, {Host: "b", Score: 1}}}
		}
		got, re := PreferImageLocal(in, DefaultImageMargin, c.holds)
		if got.Ranked[0].Host != c.wantFirst || re != c.reordered {
			t.Errorf("%s: first %s reordered %v, want %s %v", c.name, got.Ranked[0].Host, re, c.wantFirst, c.reordered)
		}
		if re && (!got.Ranked[0].ImagePreferred || !got.Ranked[0].ImageLocal) {
			t.Errorf("%s: chosen host not marked: %+v", c.name, got.Ranked[0])
		}
		if len(got.Ranked) != len(in.Ranked) {
			t.Errorf("%s: %d ranked, want %d", c.name, len(got.Ranked), len(in.Ranked))
		}
	}
	if base.Ranked[0].Host != "a" || base.Ranked[1].ImageLocal {
		t.Fatal("the input ranking was changed")
	}
}

func TestRegisteredImageSkipsImageFilter(t *testing.T) {
	h := Host{Name: "h", Alive: true, Schedulable: true, Total: Resources{4, 4096, 10000}}
	r := Reject(h, Request{Image: "debian", Resources: Resources{1, 512, 1000}})
	if r.Reason != ReasonNoImage || !strings.Contains(r.Detail, `"debian"`) {
		t.Fatalf("a built-in image the host lacks must be rejected as %s naming it, got %+v", ReasonNoImage, r)
	}
	if r := Reject(h, Request{Image: "debian", ImageSHA256: "ab", Resources: Resources{1, 512, 1000}}); r != (Rejection{}) {
		t.Fatalf("a registered image is fetched, not filtered: %+v", r)
	}
}

// A registered image skips the no_image filter but not the network one: a
// host that holds the image but lacks the VM's network is rejected with the
// reason network, and the locality preference picks among the rest.
func TestImageLocalityWithinNetworkHosts(t *testing.T) {
	host := func(name string) Host {
		return Host{Name: name, Alive: true, Schedulable: true, Total: Resources{8, 16384, 100000}}
	}
	hosts := []Host{host("a"), host("b"), host("c")}
	req := Request{Image: "debian", ImageSHA256: strings.Repeat("ab", 32), Resources: Resources{1, 512, 1000},
		NetworkHosts: []NetworkHosts{{Network: "lan", Hosts: []string{"b", "c"}}}}
	res := Rank(DefaultWeights(), hosts, req)
	if len(res.Rejected) != 1 || res.Rejected[0].Host != "a" || res.Rejected[0].Reason != ReasonNetwork ||
		!strings.Contains(res.Rejected[0].Detail, `"lan"`) {
		t.Fatalf("rejected %+v; want host a rejected as %s naming the network", res.Rejected, ReasonNetwork)
	}
	holds := map[string]bool{"a": true}
	for _, r := range res.Ranked {
		if r.Host != res.Ranked[0].Host {
			holds[r.Host] = true // the host that ranks second holds it too
		}
	}
	got, reordered := PreferImageLocal(res, DefaultImageMargin, holds)
	if !reordered || got.Ranked[0].Host == "a" || !holds[got.Ranked[0].Host] || !got.Ranked[0].ImageLocal {
		t.Fatalf("ranked %+v reordered %v; want the networked holder first, never host a", got.Ranked, reordered)
	}
}
