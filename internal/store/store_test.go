package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// eachDialect runs a test on SQLite and on PostgreSQL, each with a fresh database.
func eachDialect(t *testing.T, fn func(t *testing.T, s *store.Store)) {
	t.Run("sqlite", func(t *testing.T) { fn(t, openTest(t, store.Config{DataDir: t.TempDir()})) })
	t.Run("postgres", func(t *testing.T) { fn(t, openTest(t, store.Config{DatabaseURL: testenv.PostgresURL(t)})) })
}

func openTest(t *testing.T, cfg store.Config) *store.Store {
	t.Helper()
	s, err := store.Open(context.Background(), cfg)
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func plainCapacity(total store.Resources, ratio float64, reserved int64) store.Resources {
	return store.Resources{VCPUs: int64(float64(total.VCPUs) * ratio), MemoryMiB: total.MemoryMiB - reserved, DiskMiB: total.DiskMiB}
}

func addHost(t *testing.T, s *store.Store, name string, capacity store.Resources) store.Host {
	t.Helper()
	h, err := s.UpsertHost(context.Background(), store.Host{Name: name, Address: "127.0.0.1:1", Schedulable: true,
		CPUAllocationRatio: 1, Images: []string{"img"}, Total: capacity, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

var vmSeq atomic.Int64

func newVM(host string, r store.Resources) store.VM {
	n := vmSeq.Add(1)
	return store.VM{ID: fmt.Sprintf("vm-%08d", n), Name: fmt.Sprintf("name-%08d", n), HostName: host, Image: "img",
		Resources: r, PowerState: "running", ObservedState: "creating"}
}

func TestMigrationsAreRecordedAndAppliedOnce(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		dir := t.TempDir()
		s := openTest(t, store.Config{DataDir: dir})
		addHost(t, s, "h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		_ = s.Close()
		s = openTest(t, store.Config{DataDir: dir})
		checkMigrations(t, s)
		if _, err := s.GetHost(context.Background(), "h1"); err != nil {
			t.Errorf("data must survive a reopen: %v", err)
		}
	})
	t.Run("postgres", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		openTest(t, store.Config{DatabaseURL: url})
		checkMigrations(t, openTest(t, store.Config{DatabaseURL: url}))
	})
}

func checkMigrations(t *testing.T, s *store.Store) {
	t.Helper()
	want, err := store.MigrationVersions()
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.AppliedMigrations(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("applied migrations = %v, want %v", got, want)
	}
}

func TestReservationIsConditional(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
		if err := s.ReserveAndInsertVM(ctx, newVM("h1", store.Resources{VCPUs: 3, MemoryMiB: 3072, DiskMiB: 100})); err != nil {
			t.Fatalf("first reservation: %v", err)
		}
		tooBig := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 2048, DiskMiB: 100})
		if err := s.ReserveAndInsertVM(ctx, tooBig); !errors.Is(err, store.ErrNoRoom) {
			t.Fatalf("over capacity: err = %v, want store.ErrNoRoom", err)
		}
		if _, err := s.GetVM(ctx, tooBig.ID); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("a refused reservation must not leave a VM row: %v", err)
		}
		taken := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		first, _ := s.ListVMs(ctx, store.VMFilter{})
		taken.Name = first[0].Name
		if err := s.ReserveAndInsertVM(ctx, taken); !errors.Is(err, store.ErrDuplicateName) {
			t.Fatalf("duplicate name: err = %v, want store.ErrDuplicateName", err)
		}
		h, _ := s.GetHost(ctx, "h1")
		if want := (store.Resources{VCPUs: 3, MemoryMiB: 3072, DiskMiB: 100}); h.Allocated != want {
			t.Errorf("allocated = %+v, want %+v (refused reservations must roll back)", h.Allocated, want)
		}
	})
}

func TestReservationRefusesDeadHost(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
		if alive, err := s.RecordHostMissed(ctx, "h1", 2); err != nil || !alive {
			t.Fatalf("one miss of two: alive=%v err=%v", alive, err)
		}
		if alive, err := s.RecordHostMissed(ctx, "h1", 2); err != nil || alive {
			t.Fatalf("two misses of two: alive=%v err=%v", alive, err)
		}
		if err := s.ReserveAndInsertVM(ctx, newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})); !errors.Is(err, store.ErrNoRoom) {
			t.Errorf("dead host: err = %v, want store.ErrNoRoom", err)
		}
		if err := s.RecordHostSeen(ctx, "h1", store.HostFacts{Total: store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 1}, Images: []string{"x"}}, plainCapacity); err != nil {
			t.Fatal(err)
		}
		h, _ := s.GetHost(ctx, "h1")
		if !h.Alive || h.MissedSyncs != 0 || h.Capacity.VCPUs != 8 || !slices.Equal(h.Images, []string{"x"}) {
			t.Errorf("after a sync: %+v", h)
		}
	})
}

func TestConcurrentReservationsNeverOversubscribe(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 20, MemoryMiB: 20 * 512, DiskMiB: 20 * 100})
		var ok, full atomic.Int64
		var wg sync.WaitGroup
		for range 60 {
			wg.Go(func() {
				err := s.ReserveAndInsertVM(ctx, newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 100}))
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, store.ErrNoRoom):
					full.Add(1)
				default:
					t.Errorf("reserve: %v", err)
				}
			})
		}
		wg.Wait()
		if ok.Load() != 20 || full.Load() != 40 {
			t.Errorf("%d reserved, %d refused; want 20 and 40", ok.Load(), full.Load())
		}
		h, _ := s.GetHost(ctx, "h1")
		if h.Allocated != h.Capacity {
			t.Errorf("allocated %+v, capacity %+v", h.Allocated, h.Capacity)
		}
	})
}

func TestReleaseHappensOnce(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
		vm := newVM("h1", store.Resources{VCPUs: 2, MemoryMiB: 1024, DiskMiB: 100})
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		if _, released, err := s.ReleaseVM(ctx, vm.ID, "missing", "gone"); err != nil || !released {
			t.Fatalf("first release: released=%v err=%v", released, err)
		}
		if _, released, err := s.ReleaseVM(ctx, vm.ID, "missing", "gone"); err != nil || released {
			t.Fatalf("second release: released=%v err=%v", released, err)
		}
		if _, released, err := s.DeleteVM(ctx, vm.ID); err != nil || released {
			t.Fatalf("delete after release: released=%v err=%v", released, err)
		}
		h, _ := s.GetHost(ctx, "h1")
		if h.Allocated != (store.Resources{}) {
			t.Errorf("allocated = %+v after the only VM went, want zero", h.Allocated)
		}
		if _, _, err := s.DeleteVM(ctx, vm.ID); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("delete of a deleted VM: %v", err)
		}
	})
}

func TestDeleteHostRefusesWhileVMsArePlaced(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
		vm := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteHost(ctx, "h1"); !errors.Is(err, store.ErrHostInUse) {
			t.Fatalf("delete host with a VM: %v", err)
		}
		if _, _, err := s.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteHost(ctx, "h1"); err != nil {
			t.Fatalf("delete empty host: %v", err)
		}
		if err := s.DeleteHost(ctx, "h1"); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("delete unknown host: %v", err)
		}
	})
}

func TestListVMsFiltersAndPages(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "a", store.Resources{VCPUs: 100, MemoryMiB: 100, DiskMiB: 100})
		addHost(t, s, "b", store.Resources{VCPUs: 100, MemoryMiB: 100, DiskMiB: 100})
		fork := "fork-1"
		var ids []string
		for i := range 7 {
			vm := newVM([]string{"a", "b"}[i%2], store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
			if i < 3 {
				vm.Labels = map[string]string{"team": "red"}
				vm.ForkID = &fork
			}
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, vm.ID)
		}
		idsOf := func(vms []store.VM) []string {
			var out []string
			for _, v := range vms {
				out = append(out, v.ID)
			}
			return out
		}
		var paged []string
		after := ""
		for {
			page, err := s.ListVMs(ctx, store.VMFilter{After: after, Limit: 3})
			if err != nil {
				t.Fatal(err)
			}
			if len(page) == 0 {
				break
			}
			paged = append(paged, idsOf(page)...)
			after = page[len(page)-1].ID
		}
		if !slices.Equal(paged, ids) {
			t.Errorf("paged = %v, want %v", paged, ids)
		}
		red, _ := s.ListVMs(ctx, store.VMFilter{LabelKey: "team", LabelValue: "red"})
		forked, _ := s.ListVMs(ctx, store.VMFilter{ForkID: fork})
		onB, _ := s.ListVMs(ctx, store.VMFilter{Host: "b"})
		named, _ := s.ListVMs(ctx, store.VMFilter{Name: "no-such-name"})
		if !slices.Equal(idsOf(red), ids[:3]) || !slices.Equal(idsOf(forked), ids[:3]) ||
			!slices.Equal(idsOf(onB), []string{ids[1], ids[3], ids[5]}) || len(named) != 0 {
			t.Errorf("filters: label %v fork %v host %v name %v", idsOf(red), idsOf(forked), idsOf(onB), idsOf(named))
		}
		if err := s.SetVMLabels(ctx, ids[0], map[string]string{"team": "blue"}); err != nil {
			t.Fatal(err)
		}
		red, _ = s.ListVMs(ctx, store.VMFilter{LabelKey: "team", LabelValue: "red"})
		if !slices.Equal(idsOf(red), ids[1:3]) {
			t.Errorf("after relabel: %v", idsOf(red))
		}
	})
}

func TestIdempotencyKeyClaims(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		if _, claimed, err := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k1", "h1", time.Minute, time.Hour); err != nil || !claimed {
			t.Fatalf("new key: claimed=%v err=%v", claimed, err)
		}
		rec, claimed, err := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k1", "h1", time.Minute, time.Hour)
		if err != nil || claimed || !rec.InFlight() {
			t.Fatalf("second claim in flight: %+v claimed=%v err=%v", rec, claimed, err)
		}
		if err := s.CompleteIdempotencyKey(ctx, "vms", "c1", "k1", 201, `{"id":"x"}`); err != nil {
			t.Fatal(err)
		}
		rec, claimed, _ = s.ClaimIdempotencyKey(ctx, "vms", "c1", "k1", "h2", time.Minute, time.Hour)
		if claimed || rec.Status != 201 || rec.Response != `{"id":"x"}` || rec.RequestHash != "h1" {
			t.Fatalf("completed key: %+v claimed=%v", rec, claimed)
		}
		// Another caller's key of the same name is its own.
		if _, claimed, err := s.ClaimIdempotencyKey(ctx, "vms", "c2", "k1", "h2", time.Minute, time.Hour); err != nil || !claimed {
			t.Fatalf("caller c2's key k1 beside c1's: claimed=%v err=%v; want claimed", claimed, err)
		}
		// An abandoned request (lease over) is taken over by the same body only.
		if _, claimed, _ := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k2", "h1", -time.Second, time.Hour); !claimed {
			t.Fatal("claim k2")
		}
		if _, claimed, _ := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k2", "other", time.Minute, time.Hour); claimed {
			t.Error("a different body must not take over an abandoned key")
		}
		if _, claimed, _ := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k2", "h1", time.Minute, time.Hour); !claimed {
			t.Error("the same body must take over an abandoned key")
		}
		// A released key can be claimed again; an expired one is deleted.
		if err := s.ReleaseIdempotencyKey(ctx, "vms", "c1", "k2"); err != nil {
			t.Fatal(err)
		}
		if _, claimed, _ := s.ClaimIdempotencyKey(ctx, "vms", "c1", "k2", "h3", time.Minute, -time.Second); !claimed {
			t.Error("a released key must be free")
		}
		if n, err := s.DeleteExpiredIdempotencyKeys(ctx); err != nil || n != 1 {
			t.Errorf("expired keys deleted: %d, %v", n, err)
		}
	})
}
