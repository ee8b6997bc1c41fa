package control_test

import (
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// resizeWarmCase is a sim host with a warm pool of two warm VMs and a VM
// whose create fits beside them; the change then needs the warm VMs'
// share of one resource.
type resizeWarmCase struct {
	name     string
	capacity api.Resources // the sim agent's
	create   api.VMCreate  // a shape the warm pool does not keep: a cold create
	patch    api.VMPatch
}

func resizeWarmI64(v int64) *int64 { return &v }

// TestResizeWarmEvictsForGrowth: a VM that grows (vCPUs, memory or disk) on
// a host whose warm pool holds the room makes its agent evict warm VMs, as
// a create does, and eviction counts vCPUs and disk as well as memory: the
// user VMs and the warm VMs never take more of any resource than the host
// has. Real HTTP, sim agents.
func TestResizeWarmEvictsForGrowth(t *testing.T) {
	one := 1.0
	cases := []resizeWarmCase{
		{
			name:     "memory grows",
			capacity: api.Resources{VCPUs: 8, MemoryMiB: 2048, DiskMiB: 102400},
			create:   api.VMCreate{Name: "grows", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024},
			patch:    api.VMPatch{MemoryMiB: resizeWarmI64(1280)},
		},
		{
			name:     "vcpus grow",
			capacity: api.Resources{VCPUs: 4, MemoryMiB: 16384, DiskMiB: 102400},
			create:   api.VMCreate{Name: "grows", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024},
			patch:    api.VMPatch{VCPUs: resizeWarmI64(3)},
		},
		{
			name:     "disk grows",
			capacity: api.Resources{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 5000},
			create:   api.VMCreate{Name: "grows", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024},
			patch:    api.VMPatch{DiskMiB: resizeWarmI64(3500)},
		},
		{
			name:     "a create that needs the warm vcpus",
			capacity: api.Resources{VCPUs: 4, MemoryMiB: 16384, DiskMiB: 102400},
			create:   api.VMCreate{Name: "grows", Image: "sim", VCPUs: 3, MemoryMiB: 256, DiskMiB: 1024},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			ag := testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: tc.capacity.VCPUs,
				MemoryMiB: tc.capacity.MemoryMiB, DiskMiB: tc.capacity.DiskMiB})
			c := testenv.StartControl(t, testenv.ControlOptions{})
			if _, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: warmTarget(2),
				CPUAllocationRatio: &one}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "host h1 counts its 2 warm VMs", func() bool {
				h, err := c.Client.GetHost(ctx, "h1")
				return err == nil && h.Warm.MemoryMiB == 2*warmShape.MemoryMiB
			})
			vm, err := c.Client.CreateVM(ctx, tc.create, "")
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			if tc.patch != (api.VMPatch{}) {
				if vm, err = c.Client.UpdateVM(ctx, vm.ID, tc.patch); err != nil {
					t.Fatalf("grow the vm: %v", err)
				}
			}
			if vm.ObservedState != api.StateRunning {
				t.Fatalf("vm is %s after the change, want running", vm.ObservedState)
			}
			info, err := ag.Client.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			a, w, capa := info.Allocated, info.Warm, tc.capacity
			if a.VCPUs+w.VCPUs > capa.VCPUs || a.MemoryMiB+w.MemoryMiB > capa.MemoryMiB || a.DiskMiB+w.DiskMiB > capa.DiskMiB {
				t.Fatalf("the agent runs vms of %+v and warm vms of %+v on a host of %+v: the warm vms were not evicted", a, w, capa)
			}
			if w.MemoryMiB == 0 {
				t.Errorf("every warm vm was evicted (warm %+v); one had to go, the other fits", w)
			}
		})
	}
}
