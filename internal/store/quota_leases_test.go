package store_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// leaseTotals reads straight from the database what the quota leases of
// project hold and what its row counts as used (VMs and leases).
func leaseTotals(t *testing.T, db *sql.DB, project string) (leased, used int64) {
	t.Helper()
	if err := db.QueryRow(`SELECT COALESCE(SUM(vcpus), 0) FROM quota_leases WHERE project = $1`, project).Scan(&leased); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT used_vcpus FROM projects WHERE name = $1`, project).Scan(&used); err != nil {
		t.Fatal(err)
	}
	return leased, used
}

func openRaw(t *testing.T, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// One replica's committers hold quota leases after a burst of creates;
// another replica then creates one VM at a time until the quota refuses.
// The leases never hide room: exactly the quota is placed, the refusal
// names the quota's figures, and the usage equals the rows.
func TestQuotaLeasesNeverHideRoomUnderTheQuota(t *testing.T) {
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	a, b := openTest(t, store.Config{DatabaseURL: url}), openTest(t, store.Config{DatabaseURL: url})
	raw := openRaw(t, url)
	addHost(t, a, "h", store.Resources{VCPUs: 1000, MemoryMiB: 1000 * 64, DiskMiB: 1000 * 10})
	addProject(t, a, "team", store.Quotas{VCPUs: quota(40)})
	var wg sync.WaitGroup
	for range 12 {
		wg.Go(func() {
			vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
			vm.Project = "team"
			if err := a.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if leased, _ := leaseTotals(t, raw, "team"); leased == 0 {
		t.Fatal("no quota lease after a burst of creates: the test does not test leases")
	}
	placed := 12
	for {
		vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
		vm.Project = "team"
		err := b.ReserveAndInsertVM(ctx, vm)
		var qe *store.QuotaError
		if errors.As(err, &qe) {
			if qe.Limit != 40 || qe.Used != 40 || qe.Requested != 1 {
				t.Fatalf("refusal %+v, want limit 40, used 40, requested 1", *qe)
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		placed++
		if placed > 40 {
			t.Fatalf("%d VMs of 1 vCPU placed under a quota of 40", placed)
		}
	}
	if placed != 40 {
		t.Fatalf("%d VMs placed before the quota refused, want 40", placed)
	}
	if got, want := usageOf(t, b, "team"), rowsUsage(t, b, "team"); got != want || got.VCPUs != 40 {
		t.Fatalf("usage %+v, rows %+v; want both at 40 vCPUs", got, want)
	}
}

// Leases go back to their project when its quotas change (the usage
// recorded as the ceiling above a lowered quota is the VMs' alone) and
// when their store closes; in between, the reported usage is the rows'.
func TestQuotaLeasesGoBackOnQuotaChangeAndClose(t *testing.T) {
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	s := openTest(t, store.Config{DatabaseURL: url})
	raw := openRaw(t, url)
	addHost(t, s, "h", store.Resources{VCPUs: 1000, MemoryMiB: 1000 * 64, DiskMiB: 1000 * 10})
	addProject(t, s, "team", store.Quotas{VCPUs: quota(500)})
	burst := func(n int) {
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
				vm.Project = "team"
				if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	}
	burst(10)
	leased, used := leaseTotals(t, raw, "team")
	if leased == 0 || used != 10+leased {
		t.Fatalf("after 10 creates the leases hold %d and the row counts %d; want leases, and 10 more in the row", leased, used)
	}
	if got := usageOf(t, s, "team"); got.VCPUs != 10 {
		t.Fatalf("reported usage %d vCPUs, want the rows' 10", got.VCPUs)
	}
	if _, err := s.UpdateProject(ctx, "team", store.ProjectUpdate{Quotas: &store.Quotas{VCPUs: quota(5)}}); err != nil {
		t.Fatal(err)
	}
	if leased, used := leaseTotals(t, raw, "team"); leased != 0 || used != 10 {
		t.Fatalf("after a quota change the leases hold %d and the row counts %d; want 0 and the VMs' 10", leased, used)
	}
	vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
	vm.Project = "team"
	var qe *store.QuotaError
	if err := s.ReserveAndInsertVM(ctx, vm); !errors.As(err, &qe) {
		t.Fatalf("a create above a lowered quota: %v, want a quota refusal", err)
	}
	if _, err := s.UpdateProject(ctx, "team", store.ProjectUpdate{Quotas: &store.Quotas{}}); err != nil {
		t.Fatal(err)
	}
	burst(10)
	if leased, _ := leaseTotals(t, raw, "team"); leased == 0 {
		t.Fatal("no lease after a burst in an unlimited project")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if leased, used := leaseTotals(t, raw, "team"); leased != 0 || used != 20 {
		t.Fatalf("after the store closed the leases hold %d and the row counts %d; want 0 and the VMs' 20", leased, used)
	}
}

// A project's refusals reclaim every lease of it while batches of it and
// of another project run on both replicas: exactly the quota is placed,
// usage equals the rows, and no deadlock is broken (reclaims lock leases,
// then a host, as batches do).
func TestQuotaLeaseReclaimsBesideBatches(t *testing.T) {
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	replicas := []*store.Store{openTest(t, store.Config{DatabaseURL: url}), openTest(t, store.Config{DatabaseURL: url})}
	for i := range 4 {
		addHost(t, replicas[0], fmt.Sprintf("h%d", i), store.Resources{VCPUs: 1000, MemoryMiB: 1000 * 64, DiskMiB: 1000 * 100})
	}
	addProject(t, replicas[0], "tight", store.Quotas{VCPUs: quota(30)})
	addProject(t, replicas[0], "wide", store.Quotas{})
	var (
		wg             sync.WaitGroup
		mu             sync.Mutex
		tight, refused int
	)
	for w := range 8 {
		wg.Go(func() {
			for i := range 25 {
				vm := newVM(fmt.Sprintf("h%d", (w+i)%4), store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
				vm.Project = []string{"tight", "wide"}[i%2]
				err := replicas[w%2].ReserveAndInsertVM(ctx, vm)
				var qe *store.QuotaError
				mu.Lock()
				switch {
				case err == nil && vm.Project == "tight":
					tight++
				case errors.As(err, &qe) && vm.Project == "tight":
					refused++
				case err != nil:
					t.Errorf("create in %s: %v", vm.Project, err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	// Each worker asks for 13 VMs in tight (every even i of 25).
	if tight != 30 || tight+refused != 8*13 {
		t.Fatalf("project tight: %d placed, %d refused; want 30 and %d", tight, refused, 8*13-30)
	}
	for _, p := range []string{"tight", "wide"} {
		if got, want := usageOf(t, replicas[0], p), rowsUsage(t, replicas[0], p); got != want {
			t.Errorf("project %s: usage %+v, rows %+v", p, got, want)
		}
	}
	assertNoDeadlocks(t, url, replicas)
}
