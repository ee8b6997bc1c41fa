package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func addNATNetwork(t *testing.T, s *store.Store, name string) store.Network {
	t.Helper()
	// 10.20.0.0/24: .1 is the gateway, .2 to .254 are assignable.
	n, err := s.InsertNetwork(context.Background(), store.Network{Name: name, Mode: "nat", CIDR: "10.20.0.0/24",
		Gateway: "10.20.0.1", DHCP: true, RangeFirst: 0x0a140001, RangeLast: 0x0a1400fe, GatewayNum: 0x0a140001})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func withNIC(vm store.VM, network, mac string, address int64) store.VM {
	vm.NICs = []store.NIC{{Network: network, MACAddress: mac, Address: address}}
	return vm
}

// An address is taken with the reservation and given back with the
// release; a reclaim after another VM took it changes nothing.
func TestAddressesFollowCapacity(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		r := store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1}
		addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4, DiskMiB: 4})
		addNATNetwork(t, s, "lan")
		const addr = 0x0a140005

		a := withNIC(newVM("h1", r), "lan", "02:00:00:00:00:0a", addr)
		if err := s.ReserveAndInsertVM(ctx, a); err != nil {
			t.Fatal(err)
		}
		b := withNIC(newVM("h1", r), "lan", "02:00:00:00:00:0b", addr)
		if err := s.ReserveAndInsertVM(ctx, b); !errors.Is(err, store.ErrAddressTaken) {
			t.Fatalf("second VM on a taken address: %v, want ErrAddressTaken", err)
		}
		sameMAC := withNIC(newVM("h1", r), "lan", "02:00:00:00:00:0a", addr+1)
		if err := s.ReserveAndInsertVM(ctx, sameMAC); !errors.Is(err, store.ErrMACTaken) {
			t.Fatalf("second VM with a taken MAC: %v, want ErrMACTaken", err)
		}
		if h, _ := s.GetHost(ctx, "h1"); h.Allocated != r {
			t.Fatalf("refused reservations left allocation %+v, want %+v", h.Allocated, r)
		}
		if _, err := s.GetVM(ctx, b.ID); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("refused VM row: %v, want none", err)
		}
		if holder, err := s.AddressHolder(ctx, "lan", addr); err != nil || holder.VMID != a.ID {
			t.Fatalf("holder %+v, %v; want %s", holder, err, a.ID)
		}
		if err := s.DeleteNetwork(ctx, "lan"); !errors.Is(err, store.ErrNetworkInUse) {
			t.Fatalf("delete of a network in use: %v", err)
		}

		if _, released, err := s.ReleaseVM(ctx, a.ID, "missing", "gone"); err != nil || !released {
			t.Fatalf("release: %v, %v", released, err)
		}
		if rows, _ := s.LiveNICs(ctx); len(rows) != 0 {
			t.Fatalf("NIC rows after the release: %+v", rows)
		}
		if free, err := s.FreeAddresses(ctx, addNATView(s, t), 1); err != nil || len(free) != 1 || free[0] != 0x0a140002 {
			t.Fatalf("lowest free address %v, %v; want 10.20.0.2", free, err)
		}
		if err := s.ReserveAndInsertVM(ctx, b); err != nil {
			t.Fatalf("the released address must be free again: %v", err)
		}
		if _, err := s.ReclaimVM(ctx, a.ID, "running", "", ""); !errors.Is(err, store.ErrAddressTaken) {
			t.Fatalf("reclaim of a VM whose address was taken: %v, want ErrAddressTaken", err)
		}
		got, _ := s.GetVM(ctx, a.ID)
		if got.HoldsCapacity || got.ObservedState != "missing" {
			t.Errorf("refused reclaim changed the VM: %+v", got)
		}
		if h, _ := s.GetHost(ctx, "h1"); h.Allocated != r {
			t.Errorf("refused reclaim left allocation %+v, want %+v", h.Allocated, r)
		}
		if _, _, err := s.DeleteVM(ctx, b.ID); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteNetwork(ctx, "lan"); err != nil {
			t.Errorf("delete of a network no live NIC uses: %v", err)
		}
	})
}

func addNATView(s *store.Store, t *testing.T) store.Network {
	t.Helper()
	n, err := s.GetNetwork(context.Background(), "lan")
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A full range has no free address; the gateway is never offered.
func TestFreeAddressesSkipsGatewayAndEndsWhenFull(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 8, MemoryMiB: 8, DiskMiB: 8})
		// 10.30.0.0/29 with the gateway in the middle: .1-.6 usable, .3 gateway.
		n, err := s.InsertNetwork(ctx, store.Network{Name: "tiny", Mode: "nat", CIDR: "10.30.0.0/29", Gateway: "10.30.0.3",
			RangeFirst: 0x0a1e0001, RangeLast: 0x0a1e0006, GatewayNum: 0x0a1e0003})
		if err != nil {
			t.Fatal(err)
		}
		r := store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1}
		var got []int64
		for i := range 5 {
			free, err := s.FreeAddresses(ctx, n, 1)
			if err != nil || len(free) != 1 {
				t.Fatalf("round %d: free %v, %v", i, free, err)
			}
			got = append(got, free[0])
			vm := withNIC(newVM("h1", r), "tiny", "02:00:00:00:01:0"+string(rune('0'+i)), free[0])
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
		}
		want := []int64{0x0a1e0001, 0x0a1e0002, 0x0a1e0004, 0x0a1e0005, 0x0a1e0006}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("addresses %x, want %x", got, want)
			}
		}
		if free, err := s.FreeAddresses(ctx, n, 1); err != nil || len(free) != 0 {
			t.Errorf("full network: free %v, %v; want none", free, err)
		}
	})
}
