package control_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A hung agent: the create's attempt times out. The agent got the request
// and may still be working on it, so sending it again only waits again
// (three attempts held a create for ~3x its bound); the create fails after
// one attempt and its cleanup runs.
func TestTimedOutAgentCreateIsNotRetried(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true, AgentTimeout: 100 * time.Millisecond})
	ag := testenv.StartSlowAgent(t, testenv.AgentOptions{}, time.Hour)
	c.RegisterHost(t, "h1", ag.Address)
	if _, err := noRetry(c).CreateVM(ctx, smallVM("hung"), ""); err == nil {
		t.Fatal("a create on a hung agent succeeded")
	}
	if n := ag.Creates.Load(); n != 1 {
		t.Errorf("the agent was sent the create %d times; want once (a timed-out create is not retried blindly)", n)
	}
	checkLedger(t, c.Store)
}

// A create fails after its agent made the VM, and the cleanup's delete
// times out (the agent hangs): the row stays in error, holding capacity.
// Once the agent answers again the host monitor finishes that cleanup:
// the VM is deleted on the agent, the row removed and the capacity
// released, instead of the row taking the agent's state and holding the
// capacity of a VM whose create failed for ever.
func TestMonitorFinishesACleanupWhoseDeleteTimedOut(t *testing.T) {
	ctx := ctxT(t)
	failed := errors.New("injected database failure")
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true, AgentTimeout: 100 * time.Millisecond,
		Hooks: &control.Hooks{AfterAgentCreate: func(context.Context, string) error { return failed }}})
	ag := testenv.StartSlowAgent(t, testenv.AgentOptions{}, 0)
	ag.Slow.Store(false)
	c.RegisterHost(t, "h1", ag.Address)
	ag.HoldDeletes.Store(true)
	_, err := noRetry(c).CreateVM(ctx, smallVM("half"), "")
	if err == nil {
		t.Fatal("the create with a failing database write succeeded")
	}
	rows, err := c.Store.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 || rows[0].ObservedState != api.StateError || !rows[0].HoldsCapacity {
		t.Fatalf("after a cleanup whose delete timed out: rows %+v; want one in error holding capacity", rows)
	}
	ag.HoldDeletes.Store(false)
	c.Service.SyncNow(ctx)

	rows, err = c.Store.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 0 {
		t.Errorf("after the agent answers again: rows %+v (state %s); want the failed create's row removed", rows, rows[0].ObservedState)
	}
	list, err := ag.Client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 0 {
		t.Errorf("the agent still runs %d VMs; want the failed create's VM deleted", len(list))
	}
	checkLedger(t, c.Store)
}
