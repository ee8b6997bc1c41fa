package faulttest

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// 2,000 creates at once, split over two control replicas on one
// PostgreSQL database, against 40 hosts that fit exactly 1,200 of them:
// exactly 1,200 succeed, 800 get no_capacity, every host ends exactly
// full, none over, and rows and agents agree.
func TestTwoReplicas2000Creates(t *testing.T) {
	const (
		hosts      = 40
		perHost    = 30 // 40 x 30 = 1,200 VMs fit
		creates    = 2000
		vmMemory   = 1024
		vmDisk     = 2048
		wantPlaced = hosts * perHost
	)
	ctx := ctxT(t, 5*time.Minute)
	url := testenv.PostgresURL(t)
	replicas := []*testenv.Control{
		testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url}),
		testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url}),
	}
	agents := map[string]agentLister{}
	for i := range hosts {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: perHost, MemoryMiB: perHost * vmMemory, DiskMiB: perHost * vmDisk})
		name := fmt.Sprintf("host-%02d", i)
		replicas[0].RegisterHost(t, name, a.Address)
		agents[name] = realAgent(a)
	}
	start := time.Now()
	placed, full := testenv.CreateMany(ctx, t, replicas, creates, vmMemory, vmDisk)
	t.Logf("%d creates over 2 replicas in %v: %d placed, %d no_capacity", creates, time.Since(start).Round(time.Millisecond), placed, full)
	if placed != wantPlaced || full != creates-wantPlaced {
		t.Errorf("%d placed and %d no_capacity; want %d and %d", placed, full, wantPlaced, creates-wantPlaced)
	}
	cl := replicas[1].Client
	if err := ledger(ctx, cl, agents); err != nil {
		t.Error(err)
	}
	vms, err := cl.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != wantPlaced {
		t.Errorf("%d VM rows, want %d", len(vms), wantPlaced)
	}
	hs, err := cl.AllHosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hs {
		if h.Free != (api.Resources{}) {
			t.Errorf("host %s has %+v free; every host should be exactly full", h.Name, h.Free)
		}
	}
}
