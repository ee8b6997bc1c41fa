package control_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A host whose agent is down when the control API starts does not stop it
// from starting; the host is marked not alive, its VMs read unknown, its
// VMs cannot be deleted (they may still run), and the other hosts take the
// new VMs. When the agent is back, so is the host.
func TestDeadAgentAtStartup(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		dataDir := t.TempDir()
		first := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: dataDir})
		down := testenv.StartAgent(t, testenv.AgentOptions{})
		up := testenv.StartAgent(t, testenv.AgentOptions{})
		first.RegisterHost(t, "a-down", down.Address)
		first.RegisterHost(t, "b-up", up.Address)
		pinned := smallVM("on-a")
		pinned.Host = "a-down"
		vm, err := first.Client.CreateVM(ctx, pinned, "")
		if err != nil {
			t.Fatal(err)
		}
		first.Stop()
		down.Stop()

		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: dataDir})
		if r, err := c.Client.GetHost(ctx, "b-up"); err != nil || !r.Alive {
			t.Fatalf("the control API must answer at once: %+v %v", r, err)
		}
		eventually(t, "host a-down marked not alive", func() bool {
			h, err := c.Client.GetHost(ctx, "a-down")
			return err == nil && !h.Alive
		})
		if got, _ := c.Client.GetVM(ctx, vm.ID); got.ObservedState != api.StateUnknown {
			t.Errorf("VM on a dead host: observed_state %q, want unknown", got.ObservedState)
		}
		for _, name := range []string{"n1", "n2", "n3"} {
			got, err := c.Client.CreateVM(ctx, smallVM(name), "")
			if err != nil || got.Host != "b-up" {
				t.Fatalf("create %s with one host dead: %+v %v", name, got, err)
			}
		}
		err = noRetry(c).DeleteVM(ctx, vm.ID)
		if !errors.Is(err, client.ErrUnavailable) || !strings.Contains(err.Error(), "may still run") {
			t.Errorf("delete of a VM on a dead host: %v", err)
		}
		if got := hostAllocated(t, c, "a-down"); got != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) {
			t.Errorf("a dead host's VM must keep its capacity: %+v", got)
		}

		down.Restart(t)
		eventually(t, "host a-down alive again", func() bool {
			h, err := c.Client.GetHost(ctx, "a-down")
			return err == nil && h.Alive
		})
		if got, _ := c.Client.GetVM(ctx, vm.ID); got.ObservedState != api.StateRunning {
			t.Errorf("VM after its host came back: observed_state %q, want running", got.ObservedState)
		}
		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Errorf("delete once the host is back: %v", err)
		}
		checkLedger(t, c.Store)
	})
}

func TestHostMonitorCountsMissedSyncs(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	agent := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h1", agent.Address)
	agent.Stop()
	alive := func() bool {
		h, err := c.Client.GetHost(ctx, "h1")
		if err != nil {
			t.Fatal(err)
		}
		return h.Alive
	}
	for i := 1; i <= 2; i++ {
		c.Service.SyncNow(ctx)
		if !alive() {
			t.Fatalf("dead after %d missed syncs, want alive until 3", i)
		}
	}
	c.Service.SyncNow(ctx)
	if alive() {
		t.Fatal("alive after 3 missed syncs")
	}
	if _, err := noRetry(c).CreateVM(ctx, smallVM("x"), ""); apiCode(err) != api.CodeNoCapacity {
		t.Errorf("create with the only host dead: %v, want no_capacity", err)
	}
	agent.Restart(t)
	c.Service.SyncNow(ctx)
	if !alive() {
		t.Fatal("not alive after a sync that reached the agent")
	}
}

func TestVMThatItsAgentLacksBecomesMissing(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, NoMonitor: true})
		agent := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", agent.Address)
		vm, err := c.Client.CreateVM(ctx, smallVM("vanishing"), "")
		if err != nil {
			t.Fatal(err)
		}
		keep, err := c.Client.CreateVM(ctx, smallVM("staying"), "")
		if err != nil {
			t.Fatal(err)
		}
		if err := agent.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		c.Service.SyncNow(ctx)
		got, err := c.Client.GetVM(ctx, vm.ID)
		if err != nil || got.ObservedState != api.StateMissing || got.Reason == "" {
			t.Fatalf("VM deleted behind our back: %+v %v", got, err)
		}
		if other, _ := c.Client.GetVM(ctx, keep.ID); other.ObservedState != api.StateRunning {
			t.Errorf("the other VM: %+v", other)
		}
		if a := hostAllocated(t, c, "h1"); a != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) {
			t.Errorf("allocated %+v, want only the staying VM", a)
		}
		checkLedger(t, c.Store)
		c.Service.SyncNow(ctx) // a second round must not release twice
		checkLedger(t, c.Store)
		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatalf("delete a missing VM: %v", err)
		}
		checkLedger(t, c.Store)
	})
}

func TestPowerDriftShowsAndIsRepaired(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	agent := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h1", agent.Address)
	vm, err := c.Client.CreateVM(ctx, smallVM("drifty"), "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agent.Client.Action(ctx, vm.ID, "stop"); err != nil {
		t.Fatal(err)
	}
	c.Service.SyncNow(ctx)
	got, _ := c.Client.GetVM(ctx, vm.ID)
	if got.PowerState != api.PowerStopped || got.ObservedState != api.StateStopped {
		t.Fatalf("VM stopped behind our back reads %s/%s, want stopped/stopped", got.PowerState, got.ObservedState)
	}
	running := api.PowerRunning
	got, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &running})
	if err != nil || got.PowerState != api.PowerRunning || got.ObservedState != api.StateRunning {
		t.Fatalf("repair: %+v %v", got, err)
	}
	if a, _ := agent.Client.GetVM(ctx, vm.ID); a.State != "running" {
		t.Errorf("agent state after repair: %s", a.State)
	}
}
