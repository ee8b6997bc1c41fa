package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func groupVM(host, group, domain string, maxPerDomain int) store.VM {
	vm := newVM(host, store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
	vm.Group = store.GroupSlot{Name: group, SpreadBy: "host", Domain: domain, Cap: maxPerDomain}
	return vm
}

func counts(t *testing.T, s *store.Store, group string) map[string]int {
	t.Helper()
	c, err := s.GroupCounts(context.Background(), group, "host")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestGroupSlotCapAndRelease(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 100, MemoryMiB: 100, DiskMiB: 100})
		first := groupVM("h1", "g", "h1", 2)
		if err := s.ReserveAndInsertVM(ctx, first); err != nil {
			t.Fatal(err)
		}
		second := groupVM("h1", "g", "h1", 2)
		if err := s.ReserveAndInsertVM(ctx, second); err != nil {
			t.Fatal(err)
		}
		third := groupVM("h1", "g", "h1", 2)
		if err := s.ReserveAndInsertVM(ctx, third); !errors.Is(err, store.ErrGroupCap) {
			t.Fatalf("third VM of a group capped at 2: err = %v, want ErrGroupCap", err)
		}
		if _, err := s.GetVM(ctx, third.ID); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("a refused VM must not be inserted: %v", err)
		}
		if h, _ := s.GetHost(ctx, "h1"); h.Allocated.VCPUs != 2 {
			t.Errorf("allocated vcpus = %d, want 2: a refused group slot must reserve nothing", h.Allocated.VCPUs)
		}
		// Other groups and uncapped VMs are not limited by g's cap.
		if err := s.ReserveAndInsertVM(ctx, groupVM("h1", "other", "h1", 1)); err != nil {
			t.Fatal(err)
		}
		if err := s.ReserveAndInsertVM(ctx, groupVM("h1", "free", "h1", 0)); err != nil {
			t.Fatal(err)
		}
		if c := counts(t, s, "g"); c["h1"] != 2 {
			t.Errorf("counts = %v, want h1:2", c)
		}
		// Every release path gives the slot back exactly once.
		if _, _, err := s.ReleaseVM(ctx, first.ID, "missing", "gone"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.ReleaseVM(ctx, first.ID, "missing", "gone"); err != nil {
			t.Fatal(err)
		}
		if c := counts(t, s, "g"); c["h1"] != 1 {
			t.Errorf("after a release counts = %v, want h1:1", c)
		}
		if _, _, err := s.DeleteVM(ctx, first.ID); err != nil {
			t.Fatal(err)
		}
		if c := counts(t, s, "g"); c["h1"] != 1 {
			t.Errorf("deleting a released VM must not release twice: counts = %v", c)
		}
		// The freed slot can be taken again, and then a reclaim of the
		// missing VM... is refused by the cap.
		if err := s.ReserveAndInsertVM(ctx, third); err != nil {
			t.Fatalf("slot freed: %v", err)
		}
		missing := groupVM("h1", "g", "h1", 2)
		if err := s.ReserveAndInsertVM(ctx, missing); !errors.Is(err, store.ErrGroupCap) {
			t.Fatalf("err = %v, want ErrGroupCap", err)
		}
		if _, _, err := s.DeleteVM(ctx, second.ID); err != nil {
			t.Fatal(err)
		}
		if c := counts(t, s, "g"); c["h1"] != 1 {
			t.Errorf("after a delete counts = %v, want h1:1", c)
		}
	})
}

func TestReclaimRetakesGroupSlotUnderCapOnly(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 100, MemoryMiB: 100, DiskMiB: 100})
		a := groupVM("h1", "g", "h1", 1)
		if err := s.ReserveAndInsertVM(ctx, a); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.ReleaseVM(ctx, a.ID, "missing", "gone"); err != nil {
			t.Fatal(err)
		}
		if ok, err := s.ReclaimVM(ctx, a.ID, "running", "", ""); err != nil || !ok {
			t.Fatalf("reclaim = %v, %v", ok, err)
		}
		if c := counts(t, s, "g"); c["h1"] != 1 {
			t.Errorf("reclaim must retake the slot: counts = %v", c)
		}
		if _, _, err := s.ReleaseVM(ctx, a.ID, "missing", "gone"); err != nil {
			t.Fatal(err)
		}
		if err := s.ReserveAndInsertVM(ctx, groupVM("h1", "g", "h1", 1)); err != nil {
			t.Fatal(err)
		}
		if _, err := s.ReclaimVM(ctx, a.ID, "running", "", ""); !errors.Is(err, store.ErrGroupCap) {
			t.Fatalf("reclaim into a full domain: %v, want ErrGroupCap", err)
		}
		if h, _ := s.GetHost(ctx, "h1"); h.Allocated.VCPUs != 1 {
			t.Errorf("allocated = %d, want 1 (the refused reclaim changes nothing)", h.Allocated.VCPUs)
		}
	})
}

// Concurrent reservations of one group on one domain with a cap: exactly
// the cap succeed, on SQLite's batches and on PostgreSQL's transactions;
// a refused host gives its slot back.
func TestGroupSlotUnderConcurrency(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 100, MemoryMiB: 100, DiskMiB: 100})
		addHost(t, s, "tiny", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		var (
			wg                 sync.WaitGroup
			mu                 sync.Mutex
			ok, capped, noRoom int
		)
		for i := range 40 {
			wg.Go(func() {
				host := "h1"
				if i%4 == 0 {
					host = "tiny" // same domain name "d", host with room for one
				}
				err := s.ReserveAndInsertVM(ctx, groupVM(host, "g", "d", 5))
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					ok++
				case errors.Is(err, store.ErrGroupCap):
					capped++
				case errors.Is(err, store.ErrNoRoom):
					noRoom++
				default:
					t.Error(err)
				}
			})
		}
		wg.Wait()
		if ok != 5 || capped+noRoom != 35 {
			t.Errorf("ok=%d capped=%d noRoom=%d, want exactly 5 placed", ok, capped, noRoom)
		}
		if c := counts(t, s, "g"); c["d"] != 5 {
			t.Errorf("counts = %v, want d:5 (refused hosts give their slot back)", c)
		}
	})
}
