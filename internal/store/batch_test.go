package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Concurrent reservations share commits (one transaction on SQLite, one
// pipeline on PostgreSQL). A reservation that fails inside a shared
// commit (a taken name, a full host) must fail alone with its own error,
// and every other one must be placed exactly once: the hosts' allocations
// are the sum of the VMs that hold capacity.
func TestSharedCommitsKeepEachReservationsOutcome(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		one := store.Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 100}
		addHost(t, s, "roomy", store.Resources{VCPUs: 100, MemoryMiB: 100 * 512, DiskMiB: 100 * 100})
		addHost(t, s, "small", store.Resources{VCPUs: 5, MemoryMiB: 5 * 512, DiskMiB: 5 * 100})
		const rounds = 10
		for r := range rounds {
			var wg sync.WaitGroup
			errs := make([]error, 8)
			vms := make([]store.VM, 8)
			for i := range vms {
				host := "roomy"
				if i%2 == 1 {
					host = "small"
				}
				vms[i] = newVM(host, one)
			}
			// Two VMs of this round ask for one name, on the roomy host.
			vms[7].Name, vms[7].HostName = vms[6].Name, "roomy"
			for i := range vms {
				wg.Go(func() { errs[i] = s.ReserveAndInsertVM(ctx, vms[i]) })
			}
			wg.Wait()
			dup := 0
			for i, err := range errs {
				switch {
				case err == nil:
				case errors.Is(err, store.ErrDuplicateName) && i >= 6:
					dup++
				case errors.Is(err, store.ErrNoRoom) && vms[i].HostName == "small" && i < 6:
				default:
					t.Errorf("round %d: reserve %s on %s: %v", r, vms[i].Name, vms[i].HostName, err)
				}
			}
			if dup != 1 {
				t.Errorf("round %d: %d reservations of the shared name refused as duplicates; want exactly 1 (%v, %v)", r, dup, errs[6], errs[7])
			}
		}
		vms, err := s.ListVMs(ctx, store.VMFilter{})
		if err != nil {
			t.Fatal(err)
		}
		held := map[string]int64{}
		names := map[string]bool{}
		for _, vm := range vms {
			if vm.HoldsCapacity {
				held[vm.HostName]++
			}
			if names[vm.Name] {
				t.Errorf("name %s is held by two VMs", vm.Name)
			}
			names[vm.Name] = true
		}
		for _, name := range []string{"roomy", "small"} {
			h, err := s.GetHost(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			want := store.Resources{VCPUs: held[name], MemoryMiB: held[name] * 512, DiskMiB: held[name] * 100}
			if h.Allocated != want {
				t.Errorf("host %s allocated %+v; the VMs holding capacity there add up to %+v", name, h.Allocated, want)
			}
		}
		if held["small"] != 5 {
			t.Errorf("%d VMs on host small; want it full (5)", held["small"])
		}
		if want := int64(rounds*8 - rounds); held["roomy"]+held["small"] > want {
			t.Errorf("%d VMs placed; at most %d can be", held["roomy"]+held["small"], want)
		}
	})
}
