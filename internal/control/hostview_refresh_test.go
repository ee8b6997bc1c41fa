package control_test

import (
	"context"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Two control replicas on one database: what the second writes (a
// reservation, a host's new capacity, a host added, a host deleted) shows
// in the first's host view after a refresh, the way the host monitor
// refreshes it. On PostgreSQL the refresh reads only the rows changed since
// the last one; on SQLite (one store shared) it reloads every host.
func TestHostViewRefreshSeesOtherReplica(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		refreshSeesOtherReplica(t, openStoreT(t, store.Config{DatabaseURL: url}), openStoreT(t, store.Config{DatabaseURL: url}))
	})
	t.Run("sqlite", func(t *testing.T) {
		st := openStoreT(t, store.Config{DataDir: t.TempDir()})
		refreshSeesOtherReplica(t, st, st)
	})
}

func openStoreT(t *testing.T, cfg store.Config) *store.Store {
	t.Helper()
	st, err := store.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

func refreshSeesOtherReplica(t *testing.T, st1, st2 *store.Store) {
	ctx := context.Background()
	big := store.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 1 << 20}
	host := func(name string, r store.Resources) store.Host {
		return store.Host{Name: name, Address: "127.0.0.1:1", Schedulable: true, CPUAllocationRatio: 1,
			Images: []string{"sim"}, Total: r, Capacity: r}
	}
	if err := st2.UpsertHosts(ctx, []store.Host{host("h1", big), host("h2", big), host("h3", big)}); err != nil {
		t.Fatal(err)
	}
	r1, err := control.New(ctx, st1, control.Options{AgentToken: "unused"})
	if err != nil {
		t.Fatal(err)
	}
	r2, err := control.New(ctx, st2, control.Options{AgentToken: "unused"})
	if err != nil {
		t.Fatal(err)
	}
	// One refresh so that the next one, on PostgreSQL, reads changes only.
	if err := r1.RefreshHostView(ctx); err != nil {
		t.Fatal(err)
	}

	placed, err := r2.Reserve(ctx, control.ReserveRequest{Name: "other", Image: "sim", Resources: api.Resources{VCPUs: 2, MemoryMiB: 1024, DiskMiB: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	small := store.Resources{VCPUs: 4, MemoryMiB: 4096, DiskMiB: 4096}
	changed := "h1"
	if placed == changed {
		changed = "h2"
	}
	gone := "h3"
	if placed == gone {
		gone = "h2"
	}
	if err := st2.UpsertHosts(ctx, []store.Host{host(changed, small), host("h4", big)}); err != nil {
		t.Fatal(err)
	}
	if err := st2.DeleteHost(ctx, gone); err != nil {
		t.Fatal(err)
	}
	// Before the refresh r1 still has the picture it read.
	if h, _ := r1.ViewHost(placed); h.Allocated.VCPUs != 0 {
		t.Fatalf("host %s shows %d vCPUs allocated before any refresh; the test expects r1's view to be stale", placed, h.Allocated.VCPUs)
	}

	if err := r1.RefreshHostView(ctx); err != nil {
		t.Fatal(err)
	}
	if h, ok := r1.ViewHost(placed); !ok || h.Allocated.VCPUs != 2 {
		t.Errorf("host %s after the refresh: known %v, %d vCPUs allocated; want the other replica's reservation of 2", placed, ok, h.Allocated.VCPUs)
	}
	if h, ok := r1.ViewHost(changed); !ok || h.Total.VCPUs != small.VCPUs {
		t.Errorf("host %s after the refresh: known %v, %d vCPUs; want the new capacity %d", changed, ok, h.Total.VCPUs, small.VCPUs)
	}
	if _, ok := r1.ViewHost("h4"); !ok {
		t.Error("host h4, added by the other replica, is not in the view after the refresh")
	}
	if _, ok := r1.ViewHost(gone); ok {
		t.Errorf("host %s, deleted by the other replica, is still in the view after the refresh", gone)
	}
	if addr := r1.ViewAgentAddress("h4"); addr != "127.0.0.1:1" {
		t.Errorf("host h4's agent address in the view is %q", addr)
	}
	// And the placements of r1 use it: the deleted host is never chosen.
	for i := range 4 {
		got, err := r1.Reserve(ctx, control.ReserveRequest{Name: "mine-" + string(rune('a'+i)), Image: "sim", Resources: api.Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 512}})
		if err != nil {
			t.Fatal(err)
		}
		if got == gone {
			t.Errorf("placed on %s, which was deleted", got)
		}
	}
}
