package store_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A reservation names the project generation its placement read; once the
// project changed (or was deleted) it places nothing, alone or in a shared
// commit, and leaves the host and the usage as they were. At the current
// generation it places.
func TestReservationAtAnOldProjectGenerationPlacesNothing(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 64, MemoryMiB: 64 * 64, DiskMiB: 64 * 10})
		addProject(t, s, "team", store.Quotas{})
		old, err := s.GetProject(ctx, "team")
		if err != nil {
			t.Fatal(err)
		}
		labels := map[string]string{"tier": "gold"}
		now, err := s.UpdateProject(ctx, "team", store.ProjectUpdate{HostLabels: &labels})
		if err != nil {
			t.Fatal(err)
		}
		if now.Generation != old.Generation+1 {
			t.Fatalf("generation %d after an update of generation %d; want one more", now.Generation, old.Generation)
		}
		// Concurrent, so that PostgreSQL batches the plain ones; every
		// fourth is grouped and runs its statement alone.
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			placed  int
			changed int
			others  []error
		)
		for i := range 24 {
			wg.Go(func() {
				vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
				vm.Project = "team"
				vm.ProjectGeneration = old.Generation
				if i%2 == 0 {
					vm.ProjectGeneration = now.Generation
				}
				if i%4 == 0 {
					vm.Group = store.GroupSlot{Name: "g", SpreadBy: "host", Domain: "h"}
				}
				err := s.ReserveAndInsertVM(ctx, vm)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && vm.ProjectGeneration == now.Generation:
					placed++
				case errors.Is(err, store.ErrProjectChanged) && vm.ProjectGeneration == old.Generation:
					changed++
				default:
					others = append(others, fmt.Errorf("vm at generation %d: %v", vm.ProjectGeneration, err))
				}
			})
		}
		wg.Wait()
		for _, err := range others {
			t.Error(err)
		}
		if placed != 12 || changed != 12 {
			t.Fatalf("placed %d at the current generation and refused %d at the old one; want 12 and 12", placed, changed)
		}
		h, err := s.GetHost(ctx, "h")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := usageOf(t, s, "team"), rowsUsage(t, s, "team"); got != want || got.VMs != 12 || h.Allocated.VCPUs != 12 {
			t.Fatalf("usage %+v, rows %+v, host holds %d vCPUs; want 12 VMs everywhere", got, want, h.Allocated.VCPUs)
		}

		// A deleted project places nothing either (generation 0: any).
		addProject(t, s, "gone", store.Quotas{})
		if err := s.DeleteProject(ctx, "gone"); err != nil {
			t.Fatal(err)
		}
		vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
		vm.Project = "gone"
		if err := s.ReserveAndInsertVM(ctx, vm); !errors.Is(err, store.ErrProjectChanged) && !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("reservation in a deleted project: %v; want it refused", err)
		}
		if h2, err := s.GetHost(ctx, "h"); err != nil || h2.Allocated.VCPUs != 12 {
			t.Fatalf("host holds %d vCPUs (%v) after a reservation in a deleted project; want 12", h2.Allocated.VCPUs, err)
		}
	})
}

// Reservations (batched and alone), releases, resizes and disk growths of
// two projects on two PostgreSQL replicas all lock a host before a
// project's usage row: run together, they never deadlock (PostgreSQL
// counts every deadlock it breaks in pg_stat_database; the store retries
// them, so only the counter shows one).
func TestProjectWritersNeverDeadlock(t *testing.T) {
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	a, b := openTest(t, store.Config{DatabaseURL: url}), openTest(t, store.Config{DatabaseURL: url})
	replicas := []*store.Store{a, b}
	for i := range 4 {
		addHost(t, a, fmt.Sprintf("h%d", i), store.Resources{VCPUs: 1000, MemoryMiB: 1000 * 64, DiskMiB: 1000 * 100})
	}
	addProject(t, a, "red", store.Quotas{VCPUs: quota(10000)})
	addProject(t, a, "blue", store.Quotas{})
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		errs   []error
		placed []store.VM
	)
	note := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, err)
	}
	for w := range 8 {
		wg.Go(func() {
			s := replicas[w%2]
			for i := range 30 {
				vm := newVM(fmt.Sprintf("h%d", (w+i)%4), store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
				vm.Project = []string{"red", "blue"}[(w+i)%2]
				if i%5 == 0 {
					vm.Group = store.GroupSlot{Name: "g-" + vm.Project, SpreadBy: "host", Domain: vm.HostName}
				}
				if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
					note(fmt.Errorf("reserve %s: %w", vm.ID, err))
					continue
				}
				switch i % 3 {
				case 0:
					if _, _, err := s.DeleteVM(ctx, vm.ID); err != nil {
						note(fmt.Errorf("delete %s: %w", vm.ID, err))
					}
					continue
				case 1:
					if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 2, MemoryMiB: 128}); err != nil {
						note(fmt.Errorf("resize %s: %w", vm.ID, err))
					} else if _, _, err := s.FinishResize(ctx, vm.ID, true); err != nil {
						note(fmt.Errorf("settle resize of %s: %w", vm.ID, err))
					}
				case 2:
					if err := s.GrowVMDisk(ctx, vm.ID, vm.HostName, 10, 20); err != nil {
						note(fmt.Errorf("grow disk of %s: %w", vm.ID, err))
					}
				}
				mu.Lock()
				placed = append(placed, vm)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	for _, p := range []string{"red", "blue"} {
		if got, want := usageOf(t, a, p), rowsUsage(t, a, p); got != want {
			t.Errorf("project %s: usage %+v, rows %+v", p, got, want)
		}
	}
	if len(placed) == 0 {
		t.Fatal("nothing was placed")
	}
	assertNoDeadlocks(t, url, replicas)
}

// assertNoDeadlocks closes replicas, so that their backends report their
// statistics, and fails if PostgreSQL broke any deadlock in the test's
// database (the store retries them, so only this counter shows one).
func assertNoDeadlocks(t *testing.T, url string, replicas []*store.Store) {
	t.Helper()
	ctx := context.Background()
	for _, s := range replicas {
		_ = s.Close()
	}
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	for range 100 {
		var others int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&others); err != nil {
			t.Fatal(err)
		}
		if others == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	var deadlocks int64
	if err := db.QueryRowContext(ctx, `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&deadlocks); err != nil {
		t.Fatal(err)
	}
	if deadlocks != 0 {
		t.Fatalf("PostgreSQL broke %d deadlocks between the project's writers; want none", deadlocks)
	}
}
