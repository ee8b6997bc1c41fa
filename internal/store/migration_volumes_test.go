package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// A VM's read-write volumes move with its migration: the target holds
// their sizes from the reservation (released by an undo), the switch moves
// their rows and releases them on the source, and while the migration
// lasts the volumes are not detached or grown. A read-only volume refuses
// the reservation.
func TestMigrationMovesVolumeRows(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000})
		addHost(t, s, "h2", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 10000})
		var vols []store.Volume
		for _, size := range []int64{100, 200} {
			v := newVolume("h1", "", size)
			if err := s.ReserveAndInsertVolume(ctx, v); err != nil {
				t.Fatal(err)
			}
			if err := s.MarkVolumeReady(ctx, v.ID); err != nil {
				t.Fatal(err)
			}
			vols = append(vols, v)
		}
		shape := store.Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1000}
		vm := newVM("h1", shape)
		vm.Volumes = []store.VMVolume{{VolumeID: vols[0].ID}, {VolumeID: vols[1].ID, ReadOnly: true}}
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		disk := func(name string) int64 {
			h, err := s.GetHost(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			return h.Allocated.DiskMiB
		}
		begin := func() (store.Migration, error) {
			return s.BeginMigration(ctx, store.Migration{VMID: vm.ID, SourceHost: "h1", TargetHost: "h2", Live: true}, "")
		}
		var ve *store.MigrationVolumeError
		if _, err := begin(); !errors.As(err, &ve) || ve.Volume != vols[1].ID || !errors.Is(err, store.ErrVolumeNotReady) {
			t.Fatalf("migration with a read-only volume: %v; want a MigrationVolumeError naming %s", err, vols[1].ID)
		}
		if disk("h2") != 0 {
			t.Fatalf("a refused reservation left %d MiB on h2", disk("h2"))
		}
		if _, err := s.EndAttachment(ctx, vm.ID, vols[1].ID, store.AttachmentAttached); err != nil {
			t.Fatal(err)
		}
		m, err := begin()
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Volumes) != 1 || m.Volumes[0] != (store.MigrationVolume{ID: vols[0].ID, SizeMiB: 100}) {
			t.Fatalf("migration volumes %+v; want only %s of 100 MiB", m.Volumes, vols[0].ID)
		}
		if disk("h1") != 1300 || disk("h2") != 1100 {
			t.Fatalf("while moving: h1 %d, h2 %d MiB; want 1300 and 1100 (the vm and its volume on both)", disk("h1"), disk("h2"))
		}
		if _, err := s.BeginDetach(ctx, vm.ID, vols[0].ID, "r"); !errors.Is(err, store.ErrMigrating) {
			t.Fatalf("detach while migrating: %v; want ErrMigrating", err)
		}
		if err := s.GrowVolume(ctx, vols[0].ID, 100, 150); !errors.Is(err, store.ErrMigrating) {
			t.Fatalf("grow while migrating: %v; want ErrMigrating", err)
		}
		if _, err := s.AbortMigration(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		if disk("h1") != 1300 || disk("h2") != 0 {
			t.Fatalf("after the undo: h1 %d, h2 %d MiB; want 1300 and 0", disk("h1"), disk("h2"))
		}
		if _, err := begin(); err != nil {
			t.Fatal(err)
		}
		if _, switched, err := s.SwitchMigration(ctx, vm.ID); err != nil || !switched {
			t.Fatalf("switch: %v, %v", switched, err)
		}
		got, err := s.GetVolume(ctx, vols[0].ID)
		if err != nil || got.HostName != "h2" {
			t.Fatalf("volume after the switch on %s (%v); want h2", got.HostName, err)
		}
		if other, _ := s.GetVolume(ctx, vols[1].ID); other.HostName != "h1" {
			t.Fatalf("the detached volume moved to %s", other.HostName)
		}
		if disk("h1") != 200 || disk("h2") != 1100 {
			t.Fatalf("after the switch: h1 %d, h2 %d MiB; want 200 (the detached volume) and 1100", disk("h1"), disk("h2"))
		}
		volumeLedger(t, s)
	})
}
