package control_test

import (
	"fmt"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A placement that falls to the slow path ranks every host and explains
// every rejection. What the VM row keeps (and every GET and list page
// returns) is capped: the first rejected hosts and a count per reason for
// all, so that a fleet of 3,000 hosts does not put their whole list in
// each VM row.
func TestSlowPathPlacementExplanationIsCappedInTheRow(t *testing.T) {
	const small = 3000
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	ag := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 2, MemoryMiB: 4096, DiskMiB: 8192})
	c.RegisterHost(t, "roomy", ag.Address)
	// 3,000 hosts too small for the VM, known to the database only: the
	// host view (loaded before) learns of them in the slow path's reload.
	hosts := make([]store.Host, small)
	for i := range hosts {
		r := store.Resources{VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}
		hosts[i] = store.Host{Name: fmt.Sprintf("small-%04d", i), Address: "http://127.0.0.1:1", Schedulable: true,
			CPUAllocationRatio: 1, Images: []string{"sim"}, Total: r, Capacity: r}
	}
	if err := c.Store.UpsertHosts(ctx, hosts); err != nil {
		t.Fatal(err)
	}
	// The view believes roomy is full: its filler's row goes without the
	// view hearing of it, so the next placement's fast path finds nothing.
	filler, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "filler", Image: "sim", VCPUs: 2, MemoryMiB: 4096, DiskMiB: 8192}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Store.DeleteVM(ctx, filler.ID); err != nil {
		t.Fatal(err)
	}
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "probe", Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}, "")
	if err != nil {
		t.Fatal(err)
	}
	row, err := c.Store.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("placement explanation stored in the VM row: %d bytes, %d rejected hosts listed", len(row.Placement), len(vm.Placement.Rejected))
	if vm.Placement == nil || vm.Placement.Host != "roomy" {
		t.Fatalf("placement %+v, want roomy", vm.Placement)
	}
	if len(row.Placement) > 8<<10 {
		t.Errorf("the VM row keeps a %d-byte placement explanation; want it capped (a few KiB) whatever the fleet's size", len(row.Placement))
	}
	if got := vm.Placement.RejectedCounts[api.ReasonMemory]; got != small {
		t.Errorf("rejected_counts[memory] = %d, want %d (every rejected host counted)", got, small)
	}
	if len(vm.Placement.Rejected)+vm.Placement.RejectedOmitted != small {
		t.Errorf("%d rejections listed + %d omitted, want %d", len(vm.Placement.Rejected), vm.Placement.RejectedOmitted, small)
	}
}
