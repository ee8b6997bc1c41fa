package control_test

import (
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A fork of a fork: a child of fork P runs on h2; forking it puts its child
// on h3, which pulls the new fork's snapshot and, beneath it, P's. Deleting
// both forks must leave no snapshot on any host, the third included.
func TestForkOfAForkLeavesNoSnapshotOnAThirdHost(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	// h1: the source and one child; h2: one child; h3: roomy.
	hosts := []*forkHost{startForkHost(t, "h1", 2048), startForkHost(t, "h2", 1024), startForkHost(t, "h3", 64<<10)}
	for _, h := range hosts[:2] {
		c.RegisterHost(t, h.name, h.address)
	}
	in := smallVM("source")
	in.Host = "h1"
	src, err := c.Client.CreateVM(ctx, in, "")
	if err != nil {
		t.Fatal(err)
	}
	parent, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatal(err)
	}
	var onH2 string
	for _, ch := range parent.Children {
		if ch.Host == "h2" {
			onH2 = ch.ID
		}
	}
	if onH2 == "" {
		t.Fatalf("fork %s: no child on h2 (%+v)", parent.ID, parent.Children)
	}
	c.RegisterHost(t, hosts[2].name, hosts[2].address) // only now: the fork of the fork spills there
	child, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: onH2, Count: 1, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(child.Children) != 1 || child.Children[0].Host != "h3" {
		t.Fatalf("fork of the fork: children %+v, want one on h3", child.Children)
	}
	if d := hosts[2].snapshotDirs(t); len(d) != 2 {
		t.Logf("h3 holds snapshots %v (the fork's and its parent's expected)", d)
	}
	if err := c.Client.DeleteFork(ctx, child.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.DeleteFork(ctx, parent.ID); err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if d := h.snapshotDirs(t); len(d) != 0 {
			t.Errorf("host %s still holds snapshots %v after both forks were deleted", h.name, d)
		}
	}
}
