package control_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// After a crash the host monitor settles what the dead create left: a row
// stuck in "creating" whose agent has the VM takes the agent's state, one
// whose agent lacks it is removed with its capacity released, and a
// VM on the agent without a row is deleted there. With long grace periods
// it touches none of them.
func TestMonitorReconcilesLeftoversOfACrash(t *testing.T) {
	for _, tc := range []struct {
		name   string
		grace  time.Duration
		settle bool
	}{{"after grace", time.Millisecond, true}, {"within grace", time.Hour, false}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			ag := testenv.StartAgent(t, testenv.AgentOptions{})
			c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true, CreateGrace: tc.grace, OrphanGrace: tc.grace})
			c.RegisterHost(t, "h1", ag.Address)
			c.Service.SyncNow(ctx)

			kept, err := c.Client.CreateVM(ctx, smallVM("kept"), "")
			if err != nil {
				t.Fatal(err)
			}
			stuck, err := c.Client.CreateVM(ctx, smallVM("stuck"), "")
			if err != nil {
				t.Fatal(err)
			}
			lost, err := c.Client.CreateVM(ctx, smallVM("lost"), "")
			if err != nil {
				t.Fatal(err)
			}
			// What a kill -9 leaves: rows in creating (one whose agent never
			// got the PUT) and a VM on the agent that no row accounts for.
			for _, id := range []string{stuck.ID, lost.ID} {
				if err := c.Store.SetVMState(ctx, id, api.StateCreating, "", ""); err != nil {
					t.Fatal(err)
				}
			}
			if err := ag.Client.DeleteVM(ctx, lost.ID); err != nil {
				t.Fatal(err)
			}
			// The orphan: a VM whose row a failed create's cleanup deleted
			// (on purpose, so with a tombstone) while its agent kept it.
			const orphan = "0190aaaa-0000-7000-8000-000000000001"
			if _, err := ag.Client.CreateVM(ctx, orphan, agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 512}); err != nil {
				t.Fatal(err)
			}
			gone, err := c.Client.CreateVM(ctx, smallVM("gone"), "")
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := c.Store.DeleteVM(ctx, gone.ID); err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Millisecond) // let the millisecond grace pass; no timing is asserted

			c.Service.SyncNow(ctx)

			state := func(id string) string {
				vm, err := c.Store.GetVM(ctx, id)
				if err != nil {
					t.Fatalf("read vm %s: %v", id, err)
				}
				return vm.ObservedState
			}
			onAgent := map[string]bool{}
			list, err := ag.Client.ListVMs(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range list {
				onAgent[v.ID] = true
			}
			if state(kept.ID) != api.StateRunning || !onAgent[kept.ID] {
				t.Errorf("an ordinary VM changed: state %s, on agent %v", state(kept.ID), onAgent[kept.ID])
			}
			if tc.settle {
				if got := state(stuck.ID); got != api.StateRunning {
					t.Errorf("stuck create: state %s, want running (its agent runs it)", got)
				}
				if _, err := c.Store.GetVM(ctx, lost.ID); !errors.Is(err, store.ErrNotFound) {
					t.Errorf("the row of a create the agent never made is still there (%v); want it removed", err)
				}
				if onAgent[gone.ID] {
					t.Errorf("the VM whose row was deleted still runs on the agent")
				}
				if !onAgent[orphan] {
					t.Errorf("the VM that the database never had a row for was deleted; it must be kept for an operator")
				}
				vms, _ := c.Store.ListVMs(ctx, store.VMFilter{})
				held := 0
				for _, vm := range vms {
					if vm.HoldsCapacity {
						held++
					}
				}
				if held != 2 {
					t.Errorf("%d rows hold capacity, want 2 (kept and stuck)", held)
				}
			} else {
				if state(stuck.ID) != api.StateCreating || state(lost.ID) != api.StateCreating {
					t.Errorf("within the grace period the monitor settled creates that may still run: %s, %s",
						state(stuck.ID), state(lost.ID))
				}
				if !onAgent[orphan] || !onAgent[gone.ID] {
					t.Errorf("within the grace period the monitor deleted a VM that may be a create in flight")
				}
			}
			checkLedger(t, c.Store)
		})
	}
}

// A VM marked missing that its agent runs after all (a create the agent
// finished after the control API gave up on it) takes its capacity back
// when its host has room, and stays missing with a reason that says what
// to do when the room went to other VMs.
func TestMonitorReclaimsAMissingVMThatRuns(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fillers int
		want    string
	}{{"room left", 0, api.StateRunning}, {"host full", 2, api.StateMissing}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			ag := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 2048})
			c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
			c.RegisterHost(t, "h1", ag.Address)
			c.Service.SyncNow(ctx)
			vm, err := c.Client.CreateVM(ctx, smallVM("back"), "")
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := c.Store.ReleaseVM(ctx, vm.ID, api.StateMissing, "the agent did not have it"); err != nil {
				t.Fatal(err)
			}
			for i := range tc.fillers {
				if _, err := c.Client.CreateVM(ctx, smallVM(fmt.Sprintf("filler-%d", i)), ""); err != nil {
					t.Fatal(err)
				}
			}
			c.Service.SyncNow(ctx)
			got, err := c.Store.GetVM(ctx, vm.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.ObservedState != tc.want || got.HoldsCapacity != (tc.want == api.StateRunning) {
				t.Errorf("state %s, holds capacity %v; want %s", got.ObservedState, got.HoldsCapacity, tc.want)
			}
			if tc.want == api.StateMissing && !strings.Contains(got.Reason, "delete it") {
				t.Errorf("reason does not say what to do: %q", got.Reason)
			}
			checkLedger(t, c.Store)
		})
	}
}
