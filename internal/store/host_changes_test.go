package store_test

import (
	"context"
	"slices"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func hostNames(hs []store.Host) []string {
	var out []string
	for _, h := range hs {
		out = append(out, h.Name)
	}
	slices.Sort(out)
	return out
}

// On PostgreSQL a change read returns the hosts written since the cursor
// (a reservation, a new host) and the deleted ones, not the others; a
// reservation that commits after a read's snapshot comes in the next read.
func TestHostChangesReadsOnlyWhatChanged(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, store.Config{DatabaseURL: testenv.PostgresURL(t)})
	r := store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192}
	for _, n := range []string{"h1", "h2", "h3", "h4"} {
		addHost(t, s, n, r)
	}
	all, err := s.HostChanges(ctx, store.HostCursor{})
	if err != nil {
		t.Fatal(err)
	}
	if !all.Full || len(all.Hosts) != 4 {
		t.Fatalf("first read: full %v with %d hosts; want every host (4)", all.Full, len(all.Hosts))
	}
	none, err := s.HostChanges(ctx, all.Next)
	if err != nil {
		t.Fatal(err)
	}
	if none.Full || len(none.Hosts) != 0 || len(none.Deleted) != 0 {
		t.Fatalf("read with nothing changed: full %v, hosts %v, deleted %v; want nothing", none.Full, hostNames(none.Hosts), none.Deleted)
	}
	if err := s.ReserveAndInsertVM(ctx, newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024})); err != nil {
		t.Fatal(err)
	}
	addHost(t, s, "h5", r)
	if err := s.DeleteHost(ctx, "h2"); err != nil {
		t.Fatal(err)
	}
	ch, err := s.HostChanges(ctx, none.Next)
	if err != nil {
		t.Fatal(err)
	}
	if got := hostNames(ch.Hosts); ch.Full || !slices.Equal(got, []string{"h1", "h5"}) || !slices.Equal(ch.Deleted, []string{"h2"}) {
		t.Fatalf("after a reservation on h1, h5 added and h2 deleted: full %v, hosts %v, deleted %v", ch.Full, got, ch.Deleted)
	}
	if i := slices.IndexFunc(ch.Hosts, func(h store.Host) bool { return h.Name == "h1" }); ch.Hosts[i].Allocated.VCPUs != 1 {
		t.Errorf("h1 read with %+v allocated; want the reservation's 1 vCPU", ch.Hosts[i].Allocated)
	}

	// A transaction that wrote h3 before the read and commits after it:
	// its row is in the read after.
	db, err := s.SQLDB()
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "UPDATE hosts SET schedulable = FALSE WHERE name = 'h3'"); err != nil {
		t.Fatal(err)
	}
	during, err := s.HostChanges(ctx, ch.Next)
	if err != nil {
		t.Fatal(err)
	}
	if len(during.Hosts) != 0 {
		t.Fatalf("read while h3's update is not committed: %v; want nothing", hostNames(during.Hosts))
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	after, err := s.HostChanges(ctx, during.Next)
	if err != nil {
		t.Fatal(err)
	}
	if got := hostNames(after.Hosts); !slices.Equal(got, []string{"h3"}) || after.Hosts[0].Schedulable {
		t.Fatalf("read after h3's update committed: %v; want h3, not schedulable", got)
	}
}

// On SQLite a change read is every host.
func TestHostChangesOnSQLiteIsFull(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, store.Config{DataDir: t.TempDir()})
	addHost(t, s, "h1", store.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192})
	first, err := s.HostChanges(ctx, store.HostCursor{})
	if err != nil {
		t.Fatal(err)
	}
	again, err := s.HostChanges(ctx, first.Next)
	if err != nil {
		t.Fatal(err)
	}
	if !again.Full || len(again.Hosts) != 1 {
		t.Fatalf("second read: full %v with %d hosts; want every host", again.Full, len(again.Hosts))
	}
}
