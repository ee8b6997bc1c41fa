package faulttest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// kvmd control is killed with SIGKILL while forks run, then restarted on
// the same database: every fork that was recorded completes (ready, all
// its children running from its one snapshot, whose id is the fork's),
// and rows, agents and allocations agree.
func TestKill9DuringForks(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite", func(t *testing.T) { kill9DuringForks(t, bin, "", t.TempDir()) })
	t.Run("postgres", func(t *testing.T) { kill9DuringForks(t, bin, testenv.PostgresURL(t), "") })
}

func kill9DuringForks(t *testing.T, bin, databaseURL, dataDir string) {
	const (
		hosts    = 3
		sources  = 6
		children = 8
	)
	ctx := ctxT(t, 3*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	agents := map[string]agentLister{}
	byHost := map[string]*testenv.Agent{}
	for i := range hosts {
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		name := fmt.Sprintf("host-%d", i)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: a.Address}); err != nil {
			t.Fatal(err)
		}
		agents[name], byHost[name] = realAgent(a), a
	}
	var srcs []api.VM
	eventually(t, "hosts synced", func() error {
		_, err := k.client(false).CreateVM(ctx, smallVM("probe"), "")
		return err
	})
	for i := range sources {
		vm, err := k.client(true).CreateVM(ctx, smallVM(fmt.Sprintf("src-%d", i)), "")
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, vm)
	}

	c := k.client(false)
	var answered, cut atomic.Int64
	var killOnce sync.Once
	var wg sync.WaitGroup
	for i, src := range srcs {
		placement := api.PlacementColocate
		if i%2 == 1 {
			placement = api.PlacementSpread
		}
		wg.Go(func() {
			_, err := c.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: children, Placement: placement}, "")
			if err != nil {
				cut.Add(1)
				return
			}
			if answered.Add(1) == 1 {
				killOnce.Do(k.kill)
			}
		})
	}
	wg.Wait()
	killOnce.Do(k.kill)
	t.Logf("before the kill: %d forks answered, %d cut off", answered.Load(), cut.Load())

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	var forks []api.Fork
	eventually(t, "every recorded fork completes after the restart", func() error {
		forks = forks[:0]
		seen := map[string]bool{}
		vms, err := c2.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			return err
		}
		for _, vm := range vms {
			if vm.ForkID == "" || seen[vm.ForkID] {
				continue
			}
			seen[vm.ForkID] = true
			f, err := c2.GetFork(ctx, vm.ForkID)
			if err != nil {
				return err
			}
			if f.Phase != api.ForkReady || len(f.Children) != children {
				return fmt.Errorf("fork %s: phase %s with %d of %d children (%s)", f.ID, f.Phase, len(f.Children), children, f.Error)
			}
			forks = append(forks, f)
		}
		return ledger(ctx, c2, agents)
	})
	if int64(len(forks)) < answered.Load() {
		t.Errorf("%d forks with children after the restart, but %d were answered before the kill", len(forks), answered.Load())
	}
	for _, f := range forks {
		if !f.SnapshotTaken || f.SnapshotID != f.ID {
			t.Errorf("fork %s: snapshot %q taken=%v; want its one snapshot, named after the fork", f.ID, f.SnapshotID, f.SnapshotTaken)
		}
		for _, ch := range f.Children {
			if ch.StartedFrom != "snapshot" || ch.ObservedState != api.StateRunning {
				t.Errorf("fork %s child %s: %s, started from %q; want running from the fork's snapshot", f.ID, ch.ID, ch.ObservedState, ch.StartedFrom)
			}
		}
		src, err := c2.GetVM(ctx, f.SourceVMID)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := byHost[src.Host].Client.GetSnapshot(context.Background(), f.ID); err != nil {
			t.Errorf("fork %s: the source's agent has no snapshot %s: %v", f.ID, f.ID, err)
		}
	}
	t.Logf("after restart: %d forks complete", len(forks))

	// A fork recorded before it had any child does not show in the VM
	// list: the database itself must hold no unfinished fork.
	k2.kill()
	st, err := store.Open(ctx, store.Config{DatabaseURL: databaseURL, DataDir: dataDir})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	unfinished, err := st.UnfinishedForks(ctx, time.Now().Add(time.Hour)) // every fork, whenever written
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range unfinished {
		t.Errorf("fork %s left unfinished: phase %s, %s", f.ID, f.Phase, f.Error)
	}
}
