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
