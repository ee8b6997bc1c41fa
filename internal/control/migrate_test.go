package control_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// migrationFleet is a control plane with n sim agents h1..hn, migrating
// through the agents' migration API (the sim driver's simulated migration).
type migrationFleet struct {
	c      *testenv.Control
	agents map[string]*testenv.Agent
}

func startMigrationFleet(t *testing.T, dbURL string, n int, memoryMiB int64, opts testenv.ControlOptions) migrationFleet {
	t.Helper()
	opts.DatabaseURL = dbURL
	f := migrationFleet{c: testenv.StartControl(t, opts), agents: map[string]*testenv.Agent{}}
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("h%d", i)
		f.agents[name] = testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: 16, MemoryMiB: memoryMiB, DiskMiB: 102400})
		f.c.RegisterHost(t, name, f.agents[name].Address)
	}
	return f
}

// oneCopy checks that exactly one agent has VM id, that it is the host
// its row names, that no migration is left, and that the ledger agrees.
func (f migrationFleet) oneCopy(ctx context.Context, id string) error {
	vm, err := f.c.Client.GetVM(ctx, id)
	if err != nil {
		return err
	}
	if vm.Migration != nil {
		return fmt.Errorf("vm %s still has a migration %+v", id, *vm.Migration)
	}
	var on []string
	for name, a := range f.agents {
		if _, err := a.Client.GetVM(ctx, id); err == nil {
			on = append(on, name)
		}
	}
	if len(on) != 1 || on[0] != vm.Host {
		return fmt.Errorf("vm %s: row on %s, agents with a copy %v", id, vm.Host, on)
	}
	return nil
}

func TestMigrateMovesVMAndCapacity(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 2, 8192, testenv.ControlOptions{})
		vm, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}, "")
		if err != nil {
			t.Fatal(err)
		}
		moved, err := f.c.Client.MigrateVM(ctx, vm.ID, "")
		if err != nil {
			t.Fatalf("migrate %s: %v", vm.ID, err)
		}
		if moved.ID != vm.ID || moved.Host != "h2" || moved.ObservedState != api.StateRunning || moved.Migration != nil {
			t.Fatalf("after the migration the vm is %s on %s (%s, migration %+v); want %s running on h2, no migration",
				moved.ID, moved.Host, moved.ObservedState, moved.Migration, vm.ID)
		}
		if err := f.oneCopy(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		checkLedger(t, f.c.Store)
		if a := hostAllocated(t, f.c, "h1"); a != (api.Resources{}) {
			t.Errorf("source h1 still holds %+v after the migration", a)
		}
		if a := hostAllocated(t, f.c, "h2"); a != (api.Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024}) {
			t.Errorf("target h2 holds %+v; want the vm's shape", a)
		}

		// A stopped VM moves cold and stays stopped.
		if _, err := f.c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: ptr(api.PowerStopped)}); err != nil {
			t.Fatal(err)
		}
		back, err := f.c.Client.MigrateVM(ctx, vm.ID, "h1")
		if err != nil {
			t.Fatalf("cold migrate %s to h1: %v", vm.ID, err)
		}
		if back.Host != "h1" || back.ObservedState != api.StateStopped {
			t.Fatalf("cold migration: vm on %s %s; want stopped on h1", back.Host, back.ObservedState)
		}
		if err := f.oneCopy(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		checkLedger(t, f.c.Store)
	})
}

func TestMigrateRefusals(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 3, 4096, testenv.ControlOptions{})
		c := noRetry(f.c)
		big, err := c.CreateVM(ctx, api.VMCreate{Name: "big", Image: "sim", VCPUs: 1, MemoryMiB: 3072, DiskMiB: 1024, Host: "h1"}, "")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.MigrateVM(ctx, big.ID, "h1"); apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), "already") {
			t.Fatalf("migrate to its own host: %v; want 409 conflict", err)
		}
		// h2 and h3 fill up: no host has room.
		for _, h := range []string{"h2", "h3"} {
			if _, err := c.CreateVM(ctx, api.VMCreate{Name: "fill-" + h, Image: "sim", VCPUs: 1, MemoryMiB: 2048, DiskMiB: 1024, Host: h}, ""); err != nil {
				t.Fatal(err)
			}
		}
		_, err = c.MigrateVM(ctx, big.ID, "")
		var e *client.Error
		if !errors.As(err, &e) || e.Code != api.CodeNoCapacity {
			t.Fatalf("migrate with no room anywhere: %v; want 409 no_capacity", err)
		}
		reasons := map[string]string{}
		if rs, ok := e.Details["rejected"].([]any); ok {
			for _, r := range rs {
				m, _ := r.(map[string]any)
				host, _ := m["host"].(string)
				reason, _ := m["reason"].(string)
				reasons[host] = reason
			}
		}
		want := map[string]string{"h1": "source", "h2": "memory", "h3": "memory"}
		if fmt.Sprint(reasons) != fmt.Sprint(want) {
			t.Fatalf("reasons per host = %v; want %v (error %v)", reasons, want, err)
		}
		checkLedger(t, f.c.Store)

		// A group capped at one per host across the three hosts: a VM of
		// it cannot go where another of it is.
		var group []api.VM
		for i, h := range []string{"h2", "h3"} {
			vm, err := c.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("g%d", i), Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: h,
				Constraints: &api.Constraints{Group: "db", MaxPerDomain: 1}}, "")
			if err != nil {
				t.Fatal(err)
			}
			group = append(group, vm)
		}
		if _, err := c.MigrateVM(ctx, group[0].ID, "h3"); apiCode(err) != api.CodeNoCapacity || !strings.Contains(err.Error(), "group_cap") {
			t.Fatalf("migrate a group VM next to another of its group: %v; want 409 no_capacity naming group_cap", err)
		}
		// Draining every host but one is refused at the last.
		if _, err := c.DrainHost(ctx, "h1"); err != nil {
			t.Fatalf("drain h1: %v", err)
		}
		if _, err := c.DrainHost(ctx, "h2"); err != nil {
			t.Fatalf("drain h2: %v", err)
		}
		if _, err := c.DrainHost(ctx, "h3"); apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), "last host") {
			t.Fatalf("drain of the last schedulable host: %v; want 409 conflict", err)
		}
		for _, h := range []string{"h1", "h2"} {
			if _, err := c.UndrainHost(ctx, h); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// A migration stopped at each of its steps (as a killed process would
// leave it) is finished or undone by the host monitor: one copy runs,
// the row points at it, capacity is held on one host.
func TestMigrationStoppedAtEachStep(t *testing.T) {
	for _, tc := range []struct {
		step     string
		wantHost string
	}{
		{control.MigrationStepReserved, "h1"},
		{control.MigrationStepMoving, "h2"},
		{control.MigrationStepCompleted, "h2"},
		{control.MigrationStepSwitched, "h2"},
	} {
		t.Run(tc.step, func(t *testing.T) {
			eachDatabase(t, func(t *testing.T, dbURL string) {
				ctx := ctxT(t)
				hooks := &control.Hooks{MigrationStep: func(_ context.Context, _, step string) error {
					if step == tc.step {
						return errors.New("killed at " + step)
					}
					return nil
				}}
				f := startMigrationFleet(t, dbURL, 2, 8192, testenv.ControlOptions{Hooks: hooks, CreateGrace: time.Second})
				vm, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}, "")
				if err != nil {
					t.Fatal(err)
				}
				if _, err := noRetry(f.c).MigrateVM(ctx, vm.ID, "h2"); err == nil {
					t.Fatalf("the migration answered success although it was stopped at %s", tc.step)
				}
				eventually(t, "the host monitor settles the migration", func() bool {
					err := f.oneCopy(ctx, vm.ID)
					if err != nil {
						t.Log(err)
					}
					return err == nil
				})
				got, err := f.c.Client.GetVM(ctx, vm.ID)
				if err != nil {
					t.Fatal(err)
				}
				if got.Host != tc.wantHost || got.ObservedState != api.StateRunning {
					t.Fatalf("settled to %s (%s); want running on %s", got.Host, got.ObservedState, tc.wantHost)
				}
				checkLedger(t, f.c.Store)
			})
		})
	}
}

// While a VM moves, its answer shows the migration; afterwards it does not.
func TestMigrationShowsInTheVMWhileItRuns(t *testing.T) {
	ctx := ctxT(t)
	reached, release := make(chan struct{}), make(chan struct{})
	hooks := &control.Hooks{MigrationStep: func(ctx context.Context, _, step string) error {
		if step == control.MigrationStepMoving {
			close(reached)
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}}
	f := startMigrationFleet(t, "", 2, 8192, testenv.ControlOptions{Hooks: hooks})
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	t.Cleanup(letGo) // before the control plane stops: a failed check must not leave the hook waiting
	vm, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024, Host: "h1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := f.c.Client.MigrateVM(ctx, vm.ID, "h2")
		done <- err
	}()
	<-reached
	got, err := f.c.Client.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	if m := got.Migration; m == nil || m.State != api.MigrationMoving || m.Source != "h1" || m.Target != "h2" || !m.Live || got.Host != "h1" {
		t.Fatalf("vm while moving: host %s, migration %+v; want on h1 with a live migration h1 -> h2 moving", got.Host, got.Migration)
	}
	if err := noRetry(f.c).DeleteVM(ctx, vm.ID); apiCode(err) != api.CodeConflict {
		t.Errorf("delete while migrating: %v; want 409 conflict", err)
	}
	letGo()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := f.oneCopy(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}

// A copy that a migration left on a host the VM does not run on, with no
// migration of the VM under way (an incoming VM the target made after the
// undo's delete had found nothing), is deleted by the host monitor; the
// VM keeps running where its row says.
func TestMigrationLeftoverCopyIsDeleted(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 2, 8192, testenv.ControlOptions{OrphanGrace: time.Millisecond})
		vm, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}, "")
		if err != nil {
			t.Fatal(err)
		}
		src, dst := f.agents["h1"], f.agents["h2"]
		onSrc, err := src.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		left, err := dst.Client.PutIncoming(ctx, vm.ID, agentapi.IncomingSpec{Live: true,
			Spec:   agentapi.VMSpec{Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, NICs: onSrc.NICs},
			Source: agentapi.PeerRef{Address: src.Address, PublicKey: agentapi.EncodeKey(src.PublicKey)}})
		if err != nil || left.State != agentapi.StateIncoming {
			t.Fatalf("leave an incoming copy on h2: %+v, %v", left, err)
		}
		eventually(t, "the host monitor deletes the leftover copy", func() bool {
			_, err := dst.Client.GetVM(ctx, vm.ID)
			return errors.Is(err, agentapi.ErrNotFound)
		})
		if err := f.oneCopy(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		got, err := src.Client.GetVM(ctx, vm.ID)
		if err != nil || got.State != agentapi.StateRunning {
			t.Fatalf("vm %s on h1: %+v, %v; want running", vm.ID, got.State, err)
		}
		checkLedger(t, f.c.Store)
	})
}
