package control_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// 500 creates at once against 20 hosts that fit exactly 300 of them:
// exactly 300 succeed, 200 get no_capacity, no host is oversubscribed and
// the allocations equal the VM rows. On PostgreSQL two replicas share the
// database and split the requests.
func TestConcurrentCreatesFillCapacityExactly(t *testing.T) {
	t.Run("postgres two replicas", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		r1 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
		r2 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
		fillExactly(t, []*testenv.Control{r1, r2})
	})
	t.Run("sqlite", func(t *testing.T) {
		fillExactly(t, []*testenv.Control{testenv.StartControl(t, testenv.ControlOptions{})})
	})
}

func fillExactly(t *testing.T, replicas []*testenv.Control) {
	const (
		hosts      = 20
		perHost    = 15 // 20 x 15 = 300 VMs fit
		creates    = 500
		vmMemory   = 1024
		vmDisk     = 2048
		wantPlaced = hosts * perHost
	)
	ctx := ctxT(t)
	agents := make([]*testenv.Agent, hosts)
	for i := range agents {
		agents[i] = testenv.StartAgent(t, testenv.AgentOptions{VCPUs: perHost, MemoryMiB: perHost * vmMemory, DiskMiB: perHost * vmDisk})
		replicas[0].RegisterHost(t, fmt.Sprintf("host-%02d", i), agents[i].Address)
	}
	placed, full := testenv.CreateMany(ctx, t, replicas, creates, vmMemory, vmDisk)
	if placed != wantPlaced || full != creates-wantPlaced {
		t.Errorf("%d placed and %d no_capacity; want %d and %d", placed, full, wantPlaced, creates-wantPlaced)
	}
	checkLedger(t, replicas[0].Store)

	vms, err := replicas[len(replicas)-1].Client.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	onAgents := 0
	for _, a := range agents {
		list, err := a.Client.ListVMs(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		onAgents += len(list)
	}
	if len(vms) != wantPlaced || onAgents != wantPlaced {
		t.Errorf("%d VMs listed and %d on the agents, want %d", len(vms), onAgents, wantPlaced)
	}
	hostsList, _ := replicas[0].Client.AllHosts(ctx)
	for _, h := range hostsList {
		if h.Free != (api.Resources{}) {
			t.Errorf("host %s has %+v free; every host should be exactly full", h.Name, h.Free)
		}
	}
}
