package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func allocated(t *testing.T, s *store.Store, host string) store.Resources {
	t.Helper()
	h, err := s.GetHost(context.Background(), host)
	if err != nil {
		t.Fatal(err)
	}
	return h.Allocated
}

// A resize holds the larger shape while pending and settles to exactly the
// shape the VM ends in, whichever way it ends; a growth that does not fit
// changes nothing; a second resize waits for the first; a release of a VM
// with a pending resize gives back everything it held.
func TestResizeReservesAndSettles(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 100000})
		vm := newVM("h", store.Resources{VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1000})
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		want := func(step string, r store.Resources) {
			t.Helper()
			if got := allocated(t, s, "h"); got != r {
				t.Errorf("%s: host allocated %+v, want %+v", step, got, r)
			}
		}
		// Fewer vCPUs, more memory: only the memory growth is reserved now.
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 1, MemoryMiB: 4096}); err != nil {
			t.Fatal(err)
		}
		want("pending", store.Resources{VCPUs: 2, MemoryMiB: 4096, DiskMiB: 1000})
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 3, MemoryMiB: 2048}); !errors.Is(err, store.ErrResizing) {
			t.Errorf("second resize while one is pending: %v, want ErrResizing", err)
		}
		got, settled, err := s.FinishResize(ctx, vm.ID, true)
		if err != nil || !settled {
			t.Fatalf("finish: settled %v, %v", settled, err)
		}
		if got.Resources.VCPUs != 1 || got.Resources.MemoryMiB != 4096 {
			t.Errorf("applied resize left the row at %+v", got.Resources)
		}
		want("applied", store.Resources{VCPUs: 1, MemoryMiB: 4096, DiskMiB: 1000})
		if _, settled, _ := s.FinishResize(ctx, vm.ID, false); settled {
			t.Errorf("a settled resize settled again")
		}

		// Growth that is not applied: the growth goes back, the row keeps its shape.
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 6, MemoryMiB: 8192}); err != nil {
			t.Fatal(err)
		}
		want("pending growth", store.Resources{VCPUs: 6, MemoryMiB: 8192, DiskMiB: 1000})
		if _, _, err := s.FinishResize(ctx, vm.ID, false); err != nil {
			t.Fatal(err)
		}
		want("growth not applied", store.Resources{VCPUs: 1, MemoryMiB: 4096, DiskMiB: 1000})

		// Too big: nothing changes, and the VM can be resized again.
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 9, MemoryMiB: 4096}); !errors.Is(err, store.ErrNoRoom) {
			t.Errorf("growth past capacity: %v, want ErrNoRoom", err)
		}
		row, err := s.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if _, pending := row.Pending(); pending {
			t.Errorf("a refused resize left a pending shape")
		}
		want("refused", store.Resources{VCPUs: 1, MemoryMiB: 4096, DiskMiB: 1000})

		// A VM released (missing) with a resize pending gives back all it held.
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 4, MemoryMiB: 1024}); err != nil {
			t.Fatal(err)
		}
		if _, released, err := s.ReleaseVM(ctx, vm.ID, "missing", "gone"); err != nil || !released {
			t.Fatalf("release: %v %v", released, err)
		}
		want("released", store.Resources{})
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 2, MemoryMiB: 1024}); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("resize of a released VM: %v, want ErrNotFound", err)
		}
	})
}

// Concurrent growths of VMs on one host never oversubscribe it: the
// conditional UPDATE decides, exactly as for placements.
func TestConcurrentResizesNeverOversubscribe(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 20, MemoryMiB: 20 * 1024, DiskMiB: 100000})
		var ids []string
		for range 10 {
			vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10})
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, vm.ID)
		}
		// Each growth asks for 2 more vCPUs; 10 fit in the 10 left.
		var wg sync.WaitGroup
		var mu sync.Mutex
		ok := 0
		for _, id := range ids {
			wg.Go(func() {
				_, err := s.BeginResize(ctx, id, store.Shape{VCPUs: 3, MemoryMiB: 1024})
				switch {
				case err == nil:
					mu.Lock()
					ok++
					mu.Unlock()
				case !errors.Is(err, store.ErrNoRoom):
					t.Errorf("resize %s: %v", id, err)
				}
			})
		}
		wg.Wait()
		if ok != 5 {
			t.Errorf("%d growths of 2 vCPUs fit in 10 free vCPUs, want 5", ok)
		}
		if got := allocated(t, s, "h"); got.VCPUs != 20 {
			t.Errorf("host allocated %d vCPUs, want 20", got.VCPUs)
		}
	})
}

func TestRenameVM(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 100000})
		a, b := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1}), newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		for _, vm := range []store.VM{a, b} {
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.RenameVM(ctx, a.ID, b.Name); !errors.Is(err, store.ErrDuplicateName) {
			t.Errorf("rename to a taken name: %v, want ErrDuplicateName", err)
		}
		if err := s.RenameVM(ctx, a.ID, "fresh"); err != nil {
			t.Fatal(err)
		}
		if got, err := s.GetVMByName(ctx, store.DefaultProject, "fresh"); err != nil || got.ID != a.ID {
			t.Errorf("lookup of the new name: %+v %v", got.ID, err)
		}
		if err := s.RenameVM(ctx, "nope", "x"); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("rename of an unknown VM: %v, want ErrNotFound", err)
		}
	})
}
