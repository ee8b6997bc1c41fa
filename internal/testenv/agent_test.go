package testenv

import (
	"context"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

func TestStartAgentSimRestartKeepsVMs(t *testing.T) {
	a := StartAgent(t, AgentOptions{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
	ctx := context.Background()
	info, err := a.Client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Driver != "sim" || info.Capacity.VCPUs != 4 || len(info.Images) == 0 || info.Images[0] != "sim" {
		t.Fatalf("info = %+v, want the sim driver with 4 vcpus and image sim", info)
	}
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 128, DiskMiB: 1}
	if _, err := a.Client.CreateVM(ctx, "v1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Client.CreateVM(ctx, "v2", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Client.Action(ctx, "v2", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	a.Stop()
	if _, err := agentapi.NewClient(a.Address, a.Token, agentapi.WithRetries(0)).Info(ctx); err == nil {
		t.Fatal("a stopped agent still answers")
	}
	a.Restart(t)
	vms, err := a.Client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 2 || vms[0].State != agentapi.StateRunning || vms[1].State != agentapi.StateStopped {
		t.Fatalf("after restart: %+v, want v1 running and v2 stopped", vms)
	}
}
