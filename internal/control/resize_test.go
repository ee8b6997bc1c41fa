package control_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func ptr[T any](v T) *T { return &v }

// agentShape is the shape and state the VM's agent reports.
func agentShape(t *testing.T, a *testenv.Agent, id string) (int64, int64, string) {
	t.Helper()
	vm, err := a.Client.GetVM(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return vm.VCPUs, vm.MemoryMiB, vm.State
}

// vCPUs lowered and raised and memory raised in place: the same VM (id,
// agent VM, disk), running in each new shape, and the host's allocation
// equal to the sum of its VMs after every step.
func TestResizeInPlace(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
		c.RegisterHost(t, "h1", agent.Address)
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 4096}, "")
		if err != nil {
			t.Fatal(err)
		}
		other, err := c.Client.CreateVM(ctx, smallVM("other"), "")
		if err != nil {
			t.Fatal(err)
		}
		for _, step := range []struct {
			name        string
			patch       api.VMPatch
			vcpus, mem  int64
			wantAllocVM api.Resources
		}{
			{"vcpus lowered", api.VMPatch{VCPUs: ptr[int64](1)}, 1, 2048, api.Resources{}},
			{"vcpus raised", api.VMPatch{VCPUs: ptr[int64](4)}, 4, 2048, api.Resources{}},
			{"memory raised", api.VMPatch{MemoryMiB: ptr[int64](8192)}, 4, 8192, api.Resources{}},
			{"both at once", api.VMPatch{VCPUs: ptr[int64](3), MemoryMiB: ptr[int64](4096)}, 3, 4096, api.Resources{}},
			{"same shape again", api.VMPatch{VCPUs: ptr[int64](3), MemoryMiB: ptr[int64](4096)}, 3, 4096, api.Resources{}},
		} {
			got, err := c.Client.UpdateVM(ctx, vm.ID, step.patch)
			if err != nil {
				t.Fatalf("%s: %v", step.name, err)
			}
			if got.ID != vm.ID || got.VCPUs != step.vcpus || got.MemoryMiB != step.mem || got.DiskMiB != 4096 ||
				got.ObservedState != api.StateRunning || got.PendingResize != nil {
				t.Errorf("%s: answered %+v", step.name, got)
			}
			v, m, state := agentShape(t, agent, vm.ID)
			if v != step.vcpus || m != step.mem || state != "running" {
				t.Errorf("%s: agent runs the VM with %d vCPUs, %d MiB, %s", step.name, v, m, state)
			}
			want := api.Resources{VCPUs: step.vcpus + other.VCPUs, MemoryMiB: step.mem + other.MemoryMiB, DiskMiB: 4096 + other.DiskMiB}
			if alloc := hostAllocated(t, c, "h1"); alloc != want {
				t.Errorf("%s: host allocated %+v, want the sum of its VMs %+v", step.name, alloc, want)
			}
			checkLedger(t, c.Store)
		}
		// A stopped VM takes its new shape without starting, and starts in it.
		got, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: ptr(api.PowerStopped), MemoryMiB: ptr[int64](1024)})
		if err != nil || got.PowerState != api.PowerStopped || got.MemoryMiB != 1024 {
			t.Fatalf("stop and shrink: %+v %v", got, err)
		}
		if _, m, state := agentShape(t, agent, vm.ID); m != 1024 || state != "stopped" {
			t.Errorf("stopped and shrunk VM on its agent: %d MiB, %s", m, state)
		}
		got, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: ptr(api.PowerRunning), VCPUs: ptr[int64](2)})
		if err != nil || got.PowerState != api.PowerRunning || got.VCPUs != 2 {
			t.Fatalf("grow and start: %+v %v", got, err)
		}
		if v, _, state := agentShape(t, agent, vm.ID); v != 2 || state != "running" {
			t.Errorf("started VM on its agent: %d vCPUs, %s", v, state)
		}
		checkLedger(t, c.Store)
	})
}

// A growth that its host cannot take is 409 no_capacity naming the host and
// what is short; the VM keeps running in its old shape, nothing changes.
func TestResizeWithoutRoomIs409(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 4, MemoryMiB: 8192, DiskMiB: 100000})
		c.RegisterHost(t, "h1", agent.Address)
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 4096, DiskMiB: 1024}, "")
		if err != nil {
			t.Fatal(err)
		}
		before := hostAllocated(t, c, "h1")
		for _, tc := range []struct {
			patch api.VMPatch
			short string
		}{
			{api.VMPatch{MemoryMiB: ptr[int64](16384)}, "memory: 12288 MiB more asked, 4096 MiB free"},
			{api.VMPatch{VCPUs: ptr[int64](6)}, "cpu: 4 more vCPUs asked, 2 free"},
		} {
			_, err := noRetry(c).UpdateVM(ctx, vm.ID, tc.patch)
			if apiCode(err) != api.CodeNoCapacity || !strings.Contains(err.Error(), "host h1") || !strings.Contains(err.Error(), tc.short) {
				t.Errorf("growth past the host: %v; want no_capacity naming h1 and %q", err, tc.short)
			}
			var ce *client.Error
			if errors.As(err, &ce) && ce.Status != 409 {
				t.Errorf("status %d, want 409", ce.Status)
			}
			if v, m, state := agentShape(t, agent, vm.ID); v != 2 || m != 4096 || state != "running" {
				t.Errorf("after a refused growth the agent has %d vCPUs, %d MiB, %s; want the old shape running", v, m, state)
			}
			got, err := c.Client.GetVM(ctx, vm.ID)
			if err != nil || got.VCPUs != 2 || got.MemoryMiB != 4096 || got.PendingResize != nil {
				t.Errorf("row after a refused growth: %+v %v", got, err)
			}
			if alloc := hostAllocated(t, c, "h1"); alloc != before {
				t.Errorf("host allocated %+v after a refused growth, want %+v", alloc, before)
			}
		}
		// Bad input is 400 and changes nothing.
		for _, p := range []api.VMPatch{{VCPUs: ptr[int64](0)}, {MemoryMiB: ptr[int64](-1)}, {Name: ptr("no spaces")}} {
			if _, err := noRetry(c).UpdateVM(ctx, vm.ID, p); apiCode(err) != api.CodeInvalid {
				t.Errorf("patch %+v: %v, want invalid", p, err)
			}
		}
		checkLedger(t, c.Store)
	})
}

// A rename keeps the id; a taken name is 409 naming the VM that holds it.
func TestRenameInPlace(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", agent.Address)
		a, err := c.Client.CreateVM(ctx, smallVM("a"), "")
		if err != nil {
			t.Fatal(err)
		}
		b, err := c.Client.CreateVM(ctx, smallVM("b"), "")
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Client.UpdateVM(ctx, a.ID, api.VMPatch{Name: ptr("a-renamed")})
		if err != nil || got.ID != a.ID || got.Name != "a-renamed" {
			t.Fatalf("rename: %+v %v", got, err)
		}
		list, err := c.Client.ListVMs(ctx, client.ListOptions{Name: "a-renamed"})
		if err != nil || len(list.Items) != 1 || list.Items[0].ID != a.ID {
			t.Errorf("list by the new name: %+v %v", list.Items, err)
		}
		if list, _ := c.Client.ListVMs(ctx, client.ListOptions{Name: "a"}); len(list.Items) != 0 {
			t.Errorf("the old name still lists %+v", list.Items)
		}
		_, err = noRetry(c).UpdateVM(ctx, a.ID, api.VMPatch{Name: ptr("b")})
		if apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), b.ID) {
			t.Errorf("rename to a taken name: %v; want conflict naming %s", err, b.ID)
		}
		if got, _ := c.Client.GetVM(ctx, a.ID); got.Name != "a-renamed" {
			t.Errorf("a refused rename changed the name to %q", got.Name)
		}
		// The old name is free again.
		if _, err := c.Client.CreateVM(ctx, smallVM("a"), ""); err != nil {
			t.Errorf("create with the name given up: %v", err)
		}
	})
}

// A resize cut off by a crash, before the agent was asked or after it
// applied the change, is settled by the host monitor from the shape the
// agent reports: the row, the host's allocation and the VM agree.
func TestResizeCrashSettledByMonitor(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hooks   func(crash func(context.Context, string) error) *control.Hooks
		applied bool
	}{
		{"before the agent call", func(crash func(context.Context, string) error) *control.Hooks {
			return &control.Hooks{AfterResizeReserve: crash}
		}, false},
		{"after the agent applied it", func(crash func(context.Context, string) error) *control.Hooks {
			return &control.Hooks{AfterAgentResize: crash}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachDatabase(t, func(t *testing.T, dbURL string) {
				ctx := ctxT(t)
				crash := func(context.Context, string) error { return control.ErrSimulatedCrash }
				c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, Hooks: tc.hooks(crash),
					NoMonitor: true, CreateGrace: time.Millisecond})
				agent := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
				c.RegisterHost(t, "h1", agent.Address)
				vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024}, "")
				if err != nil {
					t.Fatal(err)
				}
				if _, err := noRetry(c).UpdateVM(ctx, vm.ID, api.VMPatch{VCPUs: ptr[int64](1), MemoryMiB: ptr[int64](4096)}); err == nil {
					t.Fatal("the crashed resize answered success")
				}
				pending, err := c.Client.GetVM(ctx, vm.ID)
				if err != nil {
					t.Fatal(err)
				}
				if pending.PendingResize == nil || *pending.PendingResize != (api.VMShape{VCPUs: 1, MemoryMiB: 4096}) {
					t.Fatalf("after the crash the row shows pending %+v, want 1 vCPU and 4096 MiB", pending.PendingResize)
				}
				// Both shapes are covered while it is pending.
				if alloc := hostAllocated(t, c, "h1"); alloc.VCPUs != 2 || alloc.MemoryMiB != 4096 {
					t.Errorf("pending resize: host allocated %+v, want the larger of both shapes", alloc)
				}
				if _, err := noRetry(c).UpdateVM(ctx, vm.ID, api.VMPatch{VCPUs: ptr[int64](3)}); apiCode(err) != api.CodeConflict {
					t.Errorf("a second resize while one is pending: %v, want conflict", err)
				}
				c.Service.SyncNow(ctx)
				got, err := c.Client.GetVM(ctx, vm.ID)
				if err != nil {
					t.Fatal(err)
				}
				v, m, state := agentShape(t, agent, vm.ID)
				wantV, wantM := int64(2), int64(2048)
				if tc.applied {
					wantV, wantM = 1, 4096
				}
				if got.PendingResize != nil || got.VCPUs != wantV || got.MemoryMiB != wantM || v != wantV || m != wantM || state != "running" {
					t.Errorf("settled: row %d vCPUs %d MiB (pending %+v), agent %d vCPUs %d MiB %s; want %d and %d running",
						got.VCPUs, got.MemoryMiB, got.PendingResize, v, m, state, wantV, wantM)
				}
				if alloc := hostAllocated(t, c, "h1"); alloc != (api.Resources{VCPUs: wantV, MemoryMiB: wantM, DiskMiB: 1024}) {
					t.Errorf("settled: host allocated %+v", alloc)
				}
				checkLedger(t, c.Store)
			})
		})
	}
}

// A fork's children and its source resize, stop and start like any VM;
// the fork stays ready with its children in their slots, and a later count
// change keeps the resized child.
func TestResizeForkChildAndSource(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		e := startForkEnv(t, dbURL, 16384, nil)
		f, err := e.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: e.source.ID, Count: 2}, "")
		if err != nil {
			t.Fatal(err)
		}
		f = e.checkFork(t, f.ID, 2)
		child := f.Children[0]
		got, err := e.c.Client.UpdateVM(ctx, child.ID, api.VMPatch{VCPUs: ptr[int64](2), MemoryMiB: ptr[int64](2048)})
		if err != nil || got.VCPUs != 2 || got.MemoryMiB != 2048 || got.ObservedState != api.StateRunning || got.ForkID != f.ID {
			t.Fatalf("resize child: %+v %v", got, err)
		}
		if _, err := e.c.Client.UpdateVM(ctx, e.source.ID, api.VMPatch{MemoryMiB: ptr[int64](2048)}); err != nil {
			t.Fatalf("resize fork source: %v", err)
		}
		for _, p := range []string{api.PowerStopped, api.PowerRunning} {
			got, err := e.c.Client.UpdateVM(ctx, child.ID, api.VMPatch{PowerState: ptr(p)})
			if err != nil || got.PowerState != p || got.VCPUs != 2 {
				t.Fatalf("child power %s: %+v %v", p, got, err)
			}
		}
		if _, err := noRetry(e.c).UpdateVM(ctx, child.ID, api.VMPatch{Name: ptr("renamed")}); apiCode(err) != api.CodeConflict {
			t.Errorf("rename of a fork child: %v, want conflict (children keep <fork>-<slot>)", err)
		}
		up := 3
		if _, err := e.c.Client.UpdateFork(ctx, f.ID, api.ForkPatch{Count: &up}); err != nil {
			t.Fatal(err)
		}
		f = e.checkFork(t, f.ID, 3)
		if f.Children[0].ID != child.ID || f.Children[0].VCPUs != 2 || f.Children[0].MemoryMiB != 2048 {
			t.Errorf("after a count change slot 0 is %+v, want the resized child %s", f.Children[0], child.ID)
		}
		if f.Children[2].VCPUs != f.Children[1].VCPUs || f.Children[2].MemoryMiB != 1024 {
			t.Errorf("a new child has %d vCPUs and %d MiB, want the snapshot's shape", f.Children[2].VCPUs, f.Children[2].MemoryMiB)
		}
	})
}
