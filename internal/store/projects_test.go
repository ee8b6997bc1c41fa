package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func quota(n int64) *int64 { return &n }

func addProject(t *testing.T, s *store.Store, name string, q store.Quotas) {
	t.Helper()
	if _, err := s.InsertProject(context.Background(), store.Project{Name: name, Quotas: q}); err != nil {
		t.Fatal(err)
	}
}

func usageOf(t *testing.T, s *store.Store, project string) store.Usage {
	t.Helper()
	p, err := s.GetProject(context.Background(), project)
	if err != nil {
		t.Fatal(err)
	}
	return p.Used
}

// rowsUsage is what the VM rows of project that hold capacity add up to.
func rowsUsage(t *testing.T, s *store.Store, project string) store.Usage {
	t.Helper()
	vms, err := s.ListVMs(context.Background(), store.VMFilter{Project: project})
	if err != nil {
		t.Fatal(err)
	}
	var u store.Usage
	for _, vm := range vms {
		if !vm.HoldsCapacity {
			continue
		}
		r := vm.Resources
		if p, ok := vm.Pending(); ok {
			r.VCPUs, r.MemoryMiB = max(r.VCPUs, p.VCPUs), max(r.MemoryMiB, p.MemoryMiB)
		}
		u.VCPUs += r.VCPUs
		u.MemoryMiB += r.MemoryMiB
		u.DiskMiB += r.DiskMiB
		u.VMs++
	}
	return u
}

// Two replicas (PostgreSQL) or one SQLite file: 200 creates of 1 vCPU
// race into a project with vcpus = 37 on hosts with room for all 200.
// Exactly 37 land, 163 are refused for the quota, and the usage row equals
// the rows; deleting them gives it all back. A third of the creates are
// grouped, so both the batched and the lone PostgreSQL statement count.
func TestProjectQuotaHoldsUnderConcurrentCreates(t *testing.T) {
	run := func(t *testing.T, replicas []*store.Store) {
		ctx := context.Background()
		s := replicas[0]
		for i := range 4 {
			addHost(t, s, fmt.Sprintf("h%d", i), store.Resources{VCPUs: 50, MemoryMiB: 50 * 64, DiskMiB: 50 * 10})
		}
		addProject(t, s, "team", store.Quotas{VCPUs: quota(37)})
		var (
			wg              sync.WaitGroup
			mu              sync.Mutex
			placed, refused int
			others          []error
		)
		for i := range 200 {
			wg.Go(func() {
				host := fmt.Sprintf("h%d", i%4)
				vm := newVM(host, store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
				vm.Project = "team"
				if i%3 == 0 {
					vm.Group = store.GroupSlot{Name: "g", SpreadBy: "host", Domain: host}
				}
				err := replicas[i%len(replicas)].ReserveAndInsertVM(ctx, vm)
				var qe *store.QuotaError
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					placed++
				case errors.As(err, &qe):
					refused++
					if qe.Project != "team" || qe.Resource != store.QuotaVCPUs || qe.Limit != 37 || qe.Requested != 1 {
						others = append(others, fmt.Errorf("quota error names the wrong figures: %+v", *qe))
					}
				default:
					others = append(others, err)
				}
			})
		}
		wg.Wait()
		for _, err := range others {
			t.Error(err)
		}
		if placed != 37 || refused != 163 {
			t.Fatalf("placed %d, refused for the quota %d; want 37 and 163", placed, refused)
		}
		if got, want := usageOf(t, s, "team"), rowsUsage(t, s, "team"); got != want || got.VCPUs != 37 {
			t.Fatalf("usage %+v, the rows hold %+v; want them equal with 37 vCPUs", got, want)
		}
		vms, err := s.ListVMs(ctx, store.VMFilter{Project: "team"})
		if err != nil {
			t.Fatal(err)
		}
		for _, vm := range vms {
			if _, _, err := s.DeleteVM(ctx, vm.ID); err != nil {
				t.Fatal(err)
			}
		}
		if got := usageOf(t, s, "team"); got != (store.Usage{}) {
			t.Fatalf("usage after deleting every VM: %+v, want zero", got)
		}
		var hostsAlloc int64
		for i := range 4 {
			h, err := s.GetHost(ctx, fmt.Sprintf("h%d", i))
			if err != nil {
				t.Fatal(err)
			}
			hostsAlloc += h.Allocated.VCPUs
		}
		if hostsAlloc != 0 {
			t.Fatalf("hosts still hold %d vCPUs after every VM was deleted", hostsAlloc)
		}
	}
	t.Run("sqlite", func(t *testing.T) { run(t, []*store.Store{openTest(t, store.Config{DataDir: t.TempDir()})}) })
	t.Run("postgres-two-replicas", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		run(t, []*store.Store{openTest(t, store.Config{DatabaseURL: url}), openTest(t, store.Config{DatabaseURL: url})})
	})
}

// A quota lowered below the usage stops nothing and refuses growth; the
// usage above it may only shrink, until it is under the quota again.
func TestProjectQuotaBelowUsageRefusesGrowthOnly(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 100000})
		addProject(t, s, "team", store.Quotas{})
		var ids []string
		for range 5 {
			vm := newVM("h", store.Resources{VCPUs: 2, MemoryMiB: 64, DiskMiB: 10})
			vm.Project = "team"
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, vm.ID)
		}
		if _, err := s.UpdateProject(ctx, "team", store.ProjectUpdate{Quotas: &store.Quotas{VCPUs: quota(5)}}); err != nil {
			t.Fatalf("a quota below the usage (10 vCPUs) is accepted: %v", err)
		}
		grow := func() error {
			vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 10})
			vm.Project = "team"
			return s.ReserveAndInsertVM(ctx, vm)
		}
		var qe *store.QuotaError
		if err := grow(); !errors.As(err, &qe) || qe.Used != 10 || qe.Limit != 5 {
			t.Fatalf("a create at 10 of 5 vCPUs: got %v, want a quota error naming 10 used of 5", err)
		}
		if _, err := s.BeginResize(ctx, ids[0], store.Shape{VCPUs: 3, MemoryMiB: 64}); !errors.As(err, &qe) {
			t.Fatalf("a resize growth above the quota: got %v, want a quota error", err)
		}
		// Releases go through although the usage stays above the quota.
		for _, id := range ids[:2] {
			if _, _, err := s.DeleteVM(ctx, id); err != nil {
				t.Fatalf("delete above the quota: %v", err)
			}
		}
		if err := grow(); !errors.As(err, &qe) {
			t.Fatalf("6 of 5 vCPUs after two deletes, then a create: got %v, want a quota error (usage above a quota only shrinks)", err)
		}
		if _, _, err := s.DeleteVM(ctx, ids[2]); err != nil {
			t.Fatal(err)
		}
		if err := grow(); err != nil {
			t.Fatalf("4 of 5 vCPUs, then a 1-vCPU create: %v", err)
		}
		if err := grow(); !errors.As(err, &qe) {
			t.Fatalf("5 of 5 vCPUs, then a create: got %v, want a quota error", err)
		}
		if got, want := usageOf(t, s, "team"), rowsUsage(t, s, "team"); got != want {
			t.Fatalf("usage %+v, rows %+v", got, want)
		}
	})
}

// A resize's growth, a disk's growth and the VM count all count, and a
// refused one changes nothing.
func TestProjectQuotaCountsResizeDiskAndVMs(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 100000})
		addProject(t, s, "team", store.Quotas{VCPUs: quota(4), DiskMiB: quota(100), VMs: quota(2)})
		vm := newVM("h", store.Resources{VCPUs: 2, MemoryMiB: 64, DiskMiB: 50})
		vm.Project = "team"
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		var qe *store.QuotaError
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 5, MemoryMiB: 64}); !errors.As(err, &qe) || qe.Resource != store.QuotaVCPUs || qe.Requested != 3 {
			t.Fatalf("resize 2 -> 5 vCPUs under a quota of 4: got %v, want a vcpus quota error for 3 more", err)
		}
		if got, _ := s.GetVM(ctx, vm.ID); got.PendingVCPUs != nil {
			t.Fatalf("a refused resize left a pending shape %d", *got.PendingVCPUs)
		}
		if _, err := s.BeginResize(ctx, vm.ID, store.Shape{VCPUs: 4, MemoryMiB: 64}); err != nil {
			t.Fatalf("resize to exactly the quota: %v", err)
		}
		if got := usageOf(t, s, "team"); got.VCPUs != 4 {
			t.Fatalf("usage during the resize: %d vCPUs, want 4 (the larger shape)", got.VCPUs)
		}
		if _, _, err := s.FinishResize(ctx, vm.ID, false); err != nil {
			t.Fatal(err)
		}
		if got := usageOf(t, s, "team"); got.VCPUs != 2 {
			t.Fatalf("usage after a resize that was not applied: %d vCPUs, want 2", got.VCPUs)
		}
		if err := s.GrowVMDisk(ctx, vm.ID, "h", 50, 120); !errors.As(err, &qe) || qe.Resource != store.QuotaDiskMiB {
			t.Fatalf("disk 50 -> 120 MiB under a quota of 100: got %v, want a disk_mib quota error", err)
		}
		if err := s.GrowVMDisk(ctx, vm.ID, "h", 50, 100); err != nil {
			t.Fatalf("disk to exactly the quota: %v", err)
		}
		second := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64})
		second.Project = "team"
		if err := s.ReserveAndInsertVM(ctx, second); err != nil {
			t.Fatal(err)
		}
		third := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64})
		third.Project = "team"
		if err := s.ReserveAndInsertVM(ctx, third); !errors.As(err, &qe) || qe.Resource != store.QuotaVMs {
			t.Fatalf("a third VM under vms = 2: got %v, want a vms quota error", err)
		}
		if got, want := usageOf(t, s, "team"), rowsUsage(t, s, "team"); got != want {
			t.Fatalf("usage %+v, rows %+v", got, want)
		}
		h, err := s.GetHost(ctx, "h")
		if err != nil {
			t.Fatal(err)
		}
		if h.Allocated.VCPUs != 3 || h.Allocated.DiskMiB != 100 {
			t.Fatalf("host allocation %+v after refusals, want 3 vCPUs and 100 MiB disk: a refusal must leave the host alone", h.Allocated)
		}
	})
}

// A project that holds anything cannot be deleted; an empty one goes with
// its tokens.
func TestProjectDeleteRefusedWhileInUseAndTakesItsTokens(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 1000})
		addProject(t, s, "team", store.Quotas{})
		vm := newVM("h", store.Resources{VCPUs: 1, MemoryMiB: 64})
		vm.Project = "team"
		if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		project := "team"
		if err := s.InsertToken(ctx, store.Token{ID: "t1", Name: "ci", SecretSHA256: "x", Scopes: []string{"user"}, Project: &project}); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteProject(ctx, "team"); !errors.Is(err, store.ErrProjectInUse) {
			t.Fatalf("delete of a project with a VM: got %v, want ErrProjectInUse", err)
		}
		if _, _, err := s.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteProject(ctx, "team"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.TokenBySecretHash(ctx, "x"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("the deleted project's token: got %v, want it gone", err)
		}
		if err := s.DeleteProject(ctx, "team"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("second delete: got %v, want ErrNotFound", err)
		}
	})
}

// A database that the code before projects made (testdata/v13, see its
// README) opens with the current code: every row is in default, default's
// usage equals what its rows hold, user-only tokens act in default and
// admin tokens stay fleet-wide.
func TestMigrationMovesExistingRowsIntoDefaultProject(t *testing.T) {
	check := func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		vms, err := s.ListVMs(ctx, store.VMFilter{})
		if err != nil {
			t.Fatal(err)
		}
		if len(vms) != 4 {
			t.Fatalf("%d VMs after the migration, want the fixture's 4", len(vms))
		}
		for _, vm := range vms {
			if vm.Project != store.DefaultProject {
				t.Errorf("vm %s is in project %q, want default", vm.ID, vm.Project)
			}
		}
		// web-1 2/1024/2048 + web-2 1/512/1024 + db 4->6 pending/4096/8192;
		// the missing VM holds nothing.
		want := store.Usage{VCPUs: 9, MemoryMiB: 5632, DiskMiB: 11264, VMs: 3}
		if got := usageOf(t, s, store.DefaultProject); got != want {
			t.Fatalf("default's usage %+v, want %+v", got, want)
		}
		if got := rowsUsage(t, s, store.DefaultProject); got != want {
			t.Fatalf("rows hold %+v, want %+v", got, want)
		}
		for hash, project := range map[string]string{"aa": "", "bb": store.DefaultProject, "cc": ""} {
			tok, err := s.TokenBySecretHash(ctx, hash)
			if err != nil {
				t.Fatal(err)
			}
			got := ""
			if tok.Project != nil {
				got = *tok.Project
			}
			if got != project {
				t.Errorf("token %s (%v) is in project %q, want %q", tok.ID, tok.Scopes, got, project)
			}
		}
		// The migrated usage keeps counting: a release gives back exactly
		// what the row held (the pending resize's larger shape).
		if _, _, err := s.DeleteVM(ctx, "vm-3"); err != nil {
			t.Fatal(err)
		}
		if got := usageOf(t, s, store.DefaultProject); got != (store.Usage{VCPUs: 3, MemoryMiB: 1536, DiskMiB: 3072, VMs: 2}) {
			t.Fatalf("default's usage after deleting db: %+v", got)
		}
	}
	t.Run("sqlite", func(t *testing.T) {
		dir := t.TempDir()
		b, err := os.ReadFile(filepath.Join("testdata", "v13", "kvmd.db"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "kvmd.db"), b, 0o600); err != nil {
			t.Fatal(err)
		}
		check(t, openTest(t, store.Config{DataDir: dir}))
	})
	t.Run("postgres", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		dump, err := os.ReadFile(filepath.Join("testdata", "v13", "postgres.sql"))
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		// The dump's statements in one simple-protocol round trip.
		if _, err := conn.Exec(ctx, string(dump), pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatalf("restore the fixture: %v", err)
		}
		// pg_dump empties search_path for its own session only.
		_ = conn.Close(ctx)
		if !strings.Contains(string(dump), "CREATE TABLE public.vms") {
			t.Fatal("the fixture has no vms table")
		}
		check(t, openTest(t, store.Config{DatabaseURL: url}))
	})
}
