package control_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func TestCreateFailingAtTheAgentLeaksNoCapacity(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", agent.Address)
		agent.FailCreates(true)

		_, err := noRetry(c).CreateVM(ctx, smallVM("doomed"), "")
		if !errors.Is(err, client.ErrUnavailable) {
			t.Fatalf("create with a failing agent: %v, want unavailable", err)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{}) {
			t.Errorf("capacity leaked: allocated %+v after a failed create", got)
		}
		if vms, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(vms) != 0 {
			t.Errorf("a failed create left VM rows: %+v", vms)
		}
		calls := agent.Calls()
		if len(calls) == 0 || calls[len(calls)-1][:6] != "DELETE" {
			t.Errorf("a create that failed at the agent must still send a delete (the PUT may have half-worked): %v", calls)
		}

		// The capacity is really free: the same VM fits once the agent works.
		agent.FailCreates(false)
		if _, err := noRetry(c).CreateVM(ctx, smallVM("doomed"), ""); err != nil {
			t.Errorf("create after the agent recovered: %v", err)
		}
		checkLedger(t, c.Store)
	})
}

func TestDatabaseFailureAfterAgentCreateDeletesBeforeReleasing(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		injected := errors.New("injected database failure")
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, Hooks: &control.Hooks{
			AfterAgentCreate: func(context.Context, string) error { return injected },
		}})
		agent := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", agent.Address)

		// When the delete reaches the agent, the capacity must still be held.
		var mu sync.Mutex
		var heldAtDelete []api.Resources
		agent.OnDelete(func(string) {
			h, err := c.Store.GetHost(context.Background(), "h1")
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			heldAtDelete = append(heldAtDelete, api.Resources{VCPUs: h.Allocated.VCPUs, MemoryMiB: h.Allocated.MemoryMiB, DiskMiB: h.Allocated.DiskMiB})
			mu.Unlock()
		})

		_, err := noRetry(c).CreateVM(ctx, smallVM("half-made"), "")
		var e *client.Error
		if !errors.As(err, &e) || e.Status != 500 {
			t.Fatalf("create with a failing database write: %v, want 500", err)
		}
		calls := agent.Calls()
		if len(calls) != 2 || calls[0][:3] != "PUT" || calls[1][:6] != "DELETE" || calls[0][4:] != calls[1][7:] {
			t.Fatalf("agent calls = %v, want the PUT then a DELETE of the same VM", calls)
		}
		mu.Lock()
		defer mu.Unlock()
		if want := (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}); !slices.Equal(heldAtDelete, []api.Resources{want}) {
			t.Errorf("allocation seen by the agent's delete = %v, want %v (release only after the delete)", heldAtDelete, want)
		}
		if ids := agent.VMIDs(); len(ids) != 0 {
			t.Errorf("the agent still has %v", ids)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{}) {
			t.Errorf("allocated %+v after the cleanup, want nothing", got)
		}
		if vms, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(vms) != 0 {
			t.Errorf("VM rows left: %+v", vms)
		}
		checkLedger(t, c.Store)
	})
}

// When the agent cannot confirm the compensating delete, the VM may still
// run there: its capacity stays reserved and the VM says why.
func TestCreateCleanupKeepsCapacityWhenTheDeleteIsNotConfirmed(t *testing.T) {
	ctx := ctxT(t)
	var agent *testenv.AgentDouble
	c := testenv.StartControl(t, testenv.ControlOptions{Hooks: &control.Hooks{
		AfterAgentCreate: func(context.Context, string) error {
			agent.Stop() // the agent goes away right after creating the VM
			return errors.New("injected database failure")
		},
	}})
	agent = testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
	c.RegisterHost(t, "h1", agent.Address)

	_, err := noRetry(c).CreateVM(ctx, smallVM("stranded"), "")
	var e *client.Error
	if !errors.As(err, &e) || e.Details["vm_id"] == nil {
		t.Fatalf("create: %v, want an error naming the kept VM", err)
	}
	vm, err := c.Service.GetVM(ctx, e.Details["vm_id"].(string))
	if err != nil {
		t.Fatal(err)
	}
	if got := hostAllocated(t, c, "h1"); got != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) {
		t.Errorf("allocated %+v: capacity must stay reserved while the VM may run", got)
	}
	if vm.Reason == "" {
		t.Errorf("the kept VM must say why: %+v", vm)
	}
	checkLedger(t, c.Store)
}
