package agent_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// A resize restarts a running VM once in its new shape, keeps a paused VM
// paused and a stopped VM stopped, survives an agent restart (the shape is
// in the VM's metadata), and a repeat of the same shape boots nothing.
func TestResizeRestartsInNewShape(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	for _, id := range []string{"run", "pause", "stop"} {
		s := spec
		s.Stopped = id == "stop"
		if _, err := h.client.CreateVM(ctx, id, s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := h.client.Action(ctx, "pause", agentapi.ActionPause); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"run": agentapi.StateRunning, "pause": agentapi.StatePaused, "stop": agentapi.StateStopped}
	for id, state := range want {
		before := h.driver.boots.Load()
		vm, err := h.client.ResizeVM(ctx, id, agentapi.VMShape{VCPUs: 4, MemoryMiB: 2048})
		if err != nil {
			t.Fatalf("resize %s: %v", id, err)
		}
		if vm.VCPUs != 4 || vm.MemoryMiB != 2048 || vm.DiskMiB != spec.DiskMiB || vm.State != state {
			t.Errorf("resize %s answered %+v, want 4 vcpus, 2048 MiB, disk kept, state %s", id, vm, state)
		}
		boots := h.driver.boots.Load() - before
		if wantBoots := map[bool]int64{true: 0, false: 1}[state == agentapi.StateStopped]; boots != wantBoots {
			t.Errorf("resize %s booted %d times, want %d", id, boots, wantBoots)
		}
		again := h.driver.boots.Load()
		if _, err := h.client.ResizeVM(ctx, id, agentapi.VMShape{VCPUs: 4, MemoryMiB: 2048}); err != nil {
			t.Fatal(err)
		}
		if h.driver.boots.Load() != again {
			t.Errorf("resize %s to the shape it has booted it again", id)
		}
	}
	info, err := h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Allocated.VCPUs != 12 || info.Allocated.MemoryMiB != 3*2048 {
		t.Errorf("agent allocation %+v, want 12 vcpus and %d MiB", info.Allocated, 3*2048)
	}
	h.stop()
	h2 := startHarness(t, dir, 0)
	for id, state := range want {
		vm, err := h2.client.GetVM(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if vm.VCPUs != 4 || vm.MemoryMiB != 2048 || vm.State != state {
			t.Errorf("after an agent restart %s is %+v, want the new shape in state %s", id, vm, state)
		}
	}
}

func TestResizeRefusesBadShapesAndUnknownVMs(t *testing.T) {
	ctx := context.Background()
	h := startHarness(t, t.TempDir(), 0)
	if _, err := h.client.CreateVM(ctx, "a", spec); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		id     string
		shape  agentapi.VMShape
		status int
	}{
		{"a", agentapi.VMShape{VCPUs: 0, MemoryMiB: 512}, http.StatusBadRequest},
		{"a", agentapi.VMShape{VCPUs: 1, MemoryMiB: 0}, http.StatusBadRequest},
		{"nope", agentapi.VMShape{VCPUs: 1, MemoryMiB: 512}, http.StatusNotFound},
	} {
		if _, err := h.client.ResizeVM(ctx, tc.id, tc.shape); statusOf(err) != tc.status {
			t.Errorf("resize %s to %+v: %v, want status %d", tc.id, tc.shape, err, tc.status)
		}
	}
	vm, err := h.client.GetVM(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if vm.VCPUs != spec.VCPUs || vm.MemoryMiB != spec.MemoryMiB || vm.State != agentapi.StateRunning {
		t.Errorf("refused resizes changed the vm: %+v", vm)
	}
}
