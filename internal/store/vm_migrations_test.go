package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// While a VM migrates both hosts hold it; the switch releases the source
// and the undo the target, each once, and a draining or full target is
// refused by the reservation's conditional UPDATE.
func TestMigrationHoldsBothHostsUntilSwitchOrUndo(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		shape := store.Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024}
		addHost(t, s, "h1", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000})
		addHost(t, s, "h2", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000})
		addHost(t, s, "h3", store.Resources{VCPUs: 1, MemoryMiB: 8192, DiskMiB: 10000})
		addHost(t, s, "h4", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000})
		vm := newVM("h1", shape)
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		alloc := func(name string) store.Resources {
			h, err := s.GetHost(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			return h.Allocated
		}
		begin := func(target string) error {
			_, err := s.BeginMigration(ctx, store.Migration{VMID: vm.ID, SourceHost: "h1", TargetHost: target, Live: true}, "")
			return err
		}
		if err := begin("h3"); !errors.Is(err, store.ErrNoRoom) {
			t.Fatalf("migration to a host without room: %v; want ErrNoRoom", err)
		}
		if _, err := s.StartDrain(ctx, "h4", "r1", 0); err != nil {
			t.Fatal(err)
		}
		if err := begin("h4"); !errors.Is(err, store.ErrNoRoom) {
			t.Fatalf("migration to a draining host: %v; want ErrNoRoom", err)
		}
		if _, err := s.GetMigration(ctx, vm.ID); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("a refused reservation left a migration: %v", err)
		}
		if err := begin("h2"); err != nil {
			t.Fatal(err)
		}
		if err := begin("h2"); !errors.Is(err, store.ErrMigrating) {
			t.Fatalf("second migration: %v; want ErrMigrating", err)
		}
		if alloc("h1") != shape || alloc("h2") != shape {
			t.Fatalf("while moving: h1 %+v, h2 %+v; want both %+v", alloc("h1"), alloc("h2"), shape)
		}
		// Undo: the target gives its share back, once.
		for range 2 {
			if _, err := s.AbortMigration(ctx, vm.ID); err != nil {
				t.Fatal(err)
			}
		}
		if alloc("h1") != shape || alloc("h2") != (store.Resources{}) {
			t.Fatalf("after the undo: h1 %+v, h2 %+v", alloc("h1"), alloc("h2"))
		}
		// Switch: the row moves and the source gives its share back, once;
		// a switched migration is never undone.
		if err := begin("h2"); err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			got, switched, err := s.SwitchMigration(ctx, vm.ID)
			if err != nil || switched != (i == 0) {
				t.Fatalf("switch %d: switched %v, %v", i, switched, err)
			}
			if i == 0 && got.HostName != "h2" {
				t.Fatalf("switched vm on %s", got.HostName)
			}
		}
		if undone, err := s.AbortMigration(ctx, vm.ID); err != nil || undone {
			t.Fatalf("undo of a switched migration: %v, %v; want nothing undone", undone, err)
		}
		if alloc("h1") != (store.Resources{}) || alloc("h2") != shape {
			t.Fatalf("after the switch: h1 %+v, h2 %+v", alloc("h1"), alloc("h2"))
		}
		if ok, err := s.FinishMigration(ctx, vm.ID); err != nil || !ok {
			t.Fatalf("finish: %v, %v", ok, err)
		}
		row, err := s.GetVM(ctx, vm.ID)
		if err != nil || row.HostName != "h2" || !row.HoldsCapacity {
			t.Fatalf("vm row after the migration: %+v, %v", row, err)
		}
	})
}
