package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestDeleteRacingReclaimLeavesNoAllocation forces, on PostgreSQL, the
// interleaving of a delete and a reclaim of the same missing VM that used to
// leak: the delete finds the VM holding nothing (so releases nothing), the
// reclaim then takes the capacity back and commits, and the delete removes
// the row that now holds it. The host stayed allocated for ever. A lock the
// test holds on the VM's label row stops the delete between its release and
// its row delete, long enough for the reclaim to run (or to queue behind
// the delete's row lock, once the delete locks the row first).
func TestDeleteRacingReclaimLeavesNoAllocation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	url := testenv.PostgresURL(t)
	s := openTest(t, store.Config{DatabaseURL: url})
	addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 10000})
	vm := newVM("h1", store.Resources{VCPUs: 2, MemoryMiB: 1024, DiskMiB: 100})
	vm.Labels = map[string]string{"race": "yes"}
	if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
		t.Fatal(err)
	}
	if _, released, err := s.ReleaseVM(ctx, vm.ID, "missing", "agent does not list it"); err != nil || !released {
		t.Fatalf("mark missing: released=%v err=%v", released, err)
	}

	holder, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Close(context.Background()) }()
	// A second connection watches the others: pg_stat_activity is read
	// once per transaction, and the holder's stays open.
	watch, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = watch.Close(context.Background()) }()
	lockTx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lockTx.Rollback(context.Background()) }()
	if _, err := lockTx.Exec(ctx, "SELECT 1 FROM vm_labels WHERE vm_id = $1 FOR UPDATE", vm.ID); err != nil {
		t.Fatal(err)
	}

	deleted := make(chan error, 1)
	go func() {
		_, _, err := s.DeleteVM(ctx, vm.ID)
		deleted <- err
	}()
	waitForLockWaiters(ctx, t, watch, 1)

	reclaimed := make(chan error, 1)
	go func() {
		_, err := s.ReclaimVM(ctx, vm.ID, "running", "", "")
		reclaimed <- err
	}()
	// The reclaim either commits now (the old interleaving) or waits for
	// the delete's lock on the VM row; either way let the delete go on.
	var reclaimErr error
	reclaimDone := false
	for !reclaimDone && lockWaiters(ctx, t, watch) < 2 {
		select {
		case reclaimErr = <-reclaimed:
			reclaimDone = true
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			t.Fatal("neither did the reclaim finish nor wait for a lock")
		}
	}
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-deleted; err != nil {
		t.Fatalf("delete: %v", err)
	}
	if !reclaimDone {
		reclaimErr = <-reclaimed
	}
	if reclaimErr != nil && !errors.Is(reclaimErr, store.ErrNotFound) {
		t.Fatalf("reclaim: %v", reclaimErr)
	}

	assertAllocationIsSumOfRows(ctx, t, s, holder, "h1")
}

// lockWaiters counts the backends of this database waiting for a lock.
func lockWaiters(ctx context.Context, t *testing.T, conn *pgx.Conn) int {
	t.Helper()
	var n int
	err := conn.QueryRow(ctx, `SELECT COUNT(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
	if err != nil {
		t.Fatalf("count lock waiters: %v", err)
	}
	return n
}

func waitForLockWaiters(ctx context.Context, t *testing.T, conn *pgx.Conn, want int) {
	t.Helper()
	for lockWaiters(ctx, t, conn) < want {
		select {
		case <-ctx.Done():
			t.Fatalf("%d backends never waited for a lock", want)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// assertAllocationIsSumOfRows checks the invariant: a host's allocation is
// the sum of what its VM rows hold.
func assertAllocationIsSumOfRows(ctx context.Context, t *testing.T, s *store.Store, conn *pgx.Conn, host string) {
	t.Helper()
	var sum store.Resources
	err := conn.QueryRow(ctx, `SELECT COALESCE(SUM(vcpus), 0), COALESCE(SUM(memory_mib), 0), COALESCE(SUM(disk_mib), 0)
		FROM vms WHERE host_name = $1 AND holds_capacity`, host).Scan(&sum.VCPUs, &sum.MemoryMiB, &sum.DiskMiB)
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.GetHost(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	if h.Allocated != sum {
		t.Errorf("host %s allocated %+v, its rows hold %+v", host, h.Allocated, sum)
	}
}
