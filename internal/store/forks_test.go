package store_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func TestForkRowsAndChildSlots(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192})
		key := "key-1"
		f := store.Fork{ID: "f1", SourceVMID: "src", SourceHost: "h1", Image: "img", Count: 2,
			Placement: "colocate", Phase: "pending", IdempotencyKey: &key, IdempotencyCaller: "alice",
			Resources: store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}}
		if err := s.InsertFork(ctx, f); err != nil {
			t.Fatal(err)
		}
		again := f
		again.ID = "f2"
		if err := s.InsertFork(ctx, again); !errors.Is(err, store.ErrDuplicateName) {
			t.Errorf("second fork with the same idempotency key: %v, want ErrDuplicateName", err)
		}
		if got, err := s.GetForkByIdempotencyKey(ctx, "alice", key); err != nil || got.ID != "f1" {
			t.Errorf("fork by key = %+v, %v", got, err)
		}
		// The key is unique per caller: another caller's fork may use it.
		other := f
		other.ID, other.IdempotencyCaller, other.Phase = "f3", "bob", "ready"
		if err := s.InsertFork(ctx, other); err != nil {
			t.Errorf("another caller's fork with the same idempotency key: %v", err)
		}
		if got, err := s.GetForkByIdempotencyKey(ctx, "bob", key); err != nil || got.ID != "f3" {
			t.Errorf("bob's fork by key = %+v, %v; want f3", got, err)
		}
		if err := s.MarkForkSnapshotTaken(ctx, "f1"); err != nil {
			t.Fatal(err)
		}
		for _, h := range []string{"h2", "h2", "h3"} {
			if err := s.AddForkSnapshotHost(ctx, "f1", h); err != nil {
				t.Fatal(err)
			}
		}
		got, err := s.GetFork(ctx, "f1")
		if err != nil {
			t.Fatal(err)
		}
		if !got.SnapshotTaken || !slices.Equal(got.SnapshotHosts, []string{"h1", "h2", "h3"}) || got.Resources != f.Resources {
			t.Errorf("fork = %+v, want snapshot taken on h1, h2, h3", got)
		}
		if un, err := s.UnfinishedForks(ctx, time.Now().Add(time.Minute)); err != nil || len(un) != 1 {
			t.Errorf("unfinished = %v, %v; want f1", un, err)
		}
		if un, err := s.UnfinishedForks(ctx, time.Now().Add(-time.Minute)); err != nil || len(un) != 0 {
			t.Errorf("unfinished before f1 was written = %v, %v; want none", un, err)
		}
		if err := s.SetForkPhase(ctx, "f1", "ready", ""); err != nil {
			t.Fatal(err)
		}
		if un, _ := s.UnfinishedForks(ctx, time.Now().Add(time.Minute)); len(un) != 0 {
			t.Errorf("unfinished after ready = %v", un)
		}

		// A slot holds one child, whatever its name.
		fork, slot := "f1", 0
		c0 := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 64})
		c0.ForkID, c0.ForkSlot = &fork, &slot
		if err := s.ReserveAndInsertVM(ctx, c0); err != nil {
			t.Fatal(err)
		}
		dup := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 64})
		dup.ForkID, dup.ForkSlot = &fork, &slot
		if err := s.ReserveAndInsertVM(ctx, dup); err == nil {
			t.Error("a second child in slot 0 was inserted")
		}
		children, err := s.ListVMs(ctx, store.VMFilter{ForkID: "f1"})
		if err != nil || len(children) != 1 || children[0].ForkSlot == nil || *children[0].ForkSlot != 0 {
			t.Errorf("children = %+v, %v; want one in slot 0", children, err)
		}
		h, err := s.GetHost(ctx, "h1")
		if err != nil || h.Allocated.MemoryMiB != 64 {
			t.Errorf("allocated after a refused duplicate slot = %+v, %v; want 64 MiB", h.Allocated, err)
		}
		if err := s.DeleteFork(ctx, "f1"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.GetFork(ctx, "f1"); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("get after delete: %v", err)
		}
	})
}
