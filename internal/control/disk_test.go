package control_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// disk_mib grows in place: the growth is reserved on the host; a shrink
// is a 400 and a growth past the host's free disk a 409 no_capacity, each
// changing nothing.
func TestGrowDisk(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 10000})
	c.RegisterHost(t, "h1", a.Address)
	ctx := context.Background()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "grow", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1000}, "")
	if err != nil {
		t.Fatal(err)
	}
	patch := func(mib int64) (api.VM, error) {
		return c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{DiskMiB: &mib})
	}
	got, err := patch(3000)
	if err != nil || got.DiskMiB != 3000 || got.ID != vm.ID {
		t.Fatalf("grow: %+v %v", got, err)
	}
	h, _ := c.Client.GetHost(ctx, "h1")
	if h.Allocated.DiskMiB != 3000 {
		t.Fatalf("host allocation %d MiB disk, want 3000", h.Allocated.DiskMiB)
	}
	if avm, err := a.Client.GetVM(ctx, vm.ID); err != nil || avm.DiskMiB != 3000 {
		t.Fatalf("agent's vm: %+v %v", avm, err)
	}
	var e *client.Error
	if _, err := patch(2000); !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "never shrink") {
		t.Fatalf("shrink: %v", err)
	}
	if _, err := patch(20000); !errors.As(err, &e) || e.Code != api.CodeNoCapacity {
		t.Fatalf("growth past the host: %v", err)
	}
	got, _ = c.Client.GetVM(ctx, vm.ID)
	h, _ = c.Client.GetHost(ctx, "h1")
	if got.DiskMiB != 3000 || h.Allocated.DiskMiB != 3000 {
		t.Fatalf("after refused changes: vm %d MiB, host %d MiB", got.DiskMiB, h.Allocated.DiskMiB)
	}
	if _, err := patch(3000); err != nil {
		t.Fatalf("same size again: %v", err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
	if h, _ = c.Client.GetHost(ctx, "h1"); h.Allocated.DiskMiB != 0 {
		t.Fatalf("after delete the host holds %d MiB disk", h.Allocated.DiskMiB)
	}
}

// A PATCH of name, shape and disk together is one change: a refused disk
// growth changes neither name nor shape, a refused resize gives the disk
// growth back, and one that fits applies all of it.
func TestGrowDiskWithRenameAndResize(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 4096, DiskMiB: 10000})
	c.RegisterHost(t, "h1", a.Address)
	ctx := context.Background()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "both", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1000}, "")
	if err != nil {
		t.Fatal(err)
	}
	i64 := func(v int64) *int64 { return &v }
	name := "renamed"
	unchanged := func(step string) {
		t.Helper()
		got, err := c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		h, _ := c.Client.GetHost(ctx, "h1")
		if got.Name != "both" || got.VCPUs != 1 || got.MemoryMiB != 512 || got.DiskMiB != 1000 ||
			h.Allocated.DiskMiB != 1000 || h.Allocated.VCPUs != 1 || h.Allocated.MemoryMiB != 512 {
			t.Fatalf("%s: vm %+v, host allocation %+v; want both unchanged", step, got, h.Allocated)
		}
		if avm, err := a.Client.GetVM(ctx, vm.ID); err != nil || avm.DiskMiB != 1000 || avm.VCPUs != 1 {
			t.Fatalf("%s: agent's vm %+v %v", step, avm, err)
		}
	}
	var e *client.Error
	_, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{Name: &name, VCPUs: i64(2), DiskMiB: i64(20000)})
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity || !strings.Contains(e.Message, "disk") {
		t.Fatalf("growth past the host with a rename and a resize: %v", err)
	}
	unchanged("refused disk growth")
	_, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{MemoryMiB: i64(8192), DiskMiB: i64(2000)})
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity || !strings.Contains(e.Message, "memory") {
		t.Fatalf("resize past the host with a disk growth that fits: %v", err)
	}
	unchanged("refused resize")

	got, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{Name: &name, VCPUs: i64(2), MemoryMiB: i64(1024), DiskMiB: i64(2000)})
	if err != nil || got.Name != name || got.VCPUs != 2 || got.MemoryMiB != 1024 || got.DiskMiB != 2000 {
		t.Fatalf("all in one PATCH: %+v %v", got, err)
	}
	h, _ := c.Client.GetHost(ctx, "h1")
	if h.Allocated.DiskMiB != 2000 || h.Allocated.VCPUs != 2 || h.Allocated.MemoryMiB != 1024 {
		t.Fatalf("host allocation %+v, want 2 vCPUs, 1024 MiB, 2000 MiB disk", h.Allocated)
	}
	if avm, err := a.Client.GetVM(ctx, vm.ID); err != nil || avm.DiskMiB != 2000 || avm.VCPUs != 2 || avm.MemoryMiB != 1024 {
		t.Fatalf("agent's vm: %+v %v", avm, err)
	}
}
