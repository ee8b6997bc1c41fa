package faulttest

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// The kill -9 tests of this file run kvmd control with its default
// settings, as an operator does (no shortened sync interval or grace
// periods): replica leases, not a 15-minute grace, settle what a killed
// replica left. On PostgreSQL a second replica keeps running and settles
// it; on SQLite the one replica is restarted. Each logs the time from the
// kill to the moment control plane and agents agree (ledger).
//
// KVM_KILL9_RUNS=N repeats each case N times and logs p50 and max.

func kill9Runs() int {
	n, err := strconv.Atoi(os.Getenv("KVM_KILL9_RUNS"))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// repeatKill9 runs one scenario kill9Runs() times and logs the times.
func repeatKill9(t *testing.T, what string, run func(t *testing.T) time.Duration) {
	var took []time.Duration
	for i := range kill9Runs() {
		t.Run(fmt.Sprintf("run-%d", i), func(t *testing.T) { took = append(took, run(t)) })
	}
	if len(took) == 0 {
		return
	}
	slices.Sort(took)
	t.Logf("%s: kill -9 to agreement over %d runs: p50 %v, max %v (all %v)", what, len(took),
		took[len(took)/2].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond), took)
}

func TestKill9DefaultsDuringCreates(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite-restart", func(t *testing.T) {
		repeatKill9(t, "creates, SQLite, restarted", func(t *testing.T) time.Duration {
			return kill9CreatesDefaults(t, bin, "", t.TempDir())
		})
	})
	t.Run("postgres-second-replica", func(t *testing.T) {
		repeatKill9(t, "creates, PostgreSQL, second replica", func(t *testing.T) time.Duration {
			return kill9CreatesDefaults(t, bin, testenv.PostgresURL(t), "")
		})
	})
}

func TestKill9DefaultsDuringForks(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite-restart", func(t *testing.T) {
		repeatKill9(t, "forks, SQLite, restarted", func(t *testing.T) time.Duration {
			return kill9ForksDefaults(t, bin, "", t.TempDir())
		})
	})
	t.Run("postgres-second-replica", func(t *testing.T) {
		repeatKill9(t, "forks, PostgreSQL, second replica", func(t *testing.T) time.Duration {
			return kill9ForksDefaults(t, bin, testenv.PostgresURL(t), "")
		})
	})
}

// defaultsFleet starts kvmd control with default settings (and, on
// PostgreSQL, a second replica on the same database), registers hosts
// with sim agents and waits until they are synced.
func defaultsFleet(t *testing.T, bin, databaseURL, dataDir string, hosts int) (k, second *kvmdControl, agents map[string]agentLister) {
	ctx := ctxT(t, time.Minute)
	k = startKVMDFlags(t, bin, databaseURL, dataDir, nil)
	if databaseURL != "" {
		second = startKVMDFlags(t, bin, databaseURL, dataDir, nil)
	}
	agents = map[string]agentLister{}
	for i := range hosts {
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		name := fmt.Sprintf("host-%d", i)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: a.Address}); err != nil {
			t.Fatal(err)
		}
		agents[name] = realAgent(a)
	}
	eventually(t, "the hosts are synced", func() error {
		_, err := k.client(false).CreateVM(ctx, smallVM("probe"), "")
		return err
	})
	return k, second, agents
}

// afterKill returns the replica that settles: the second one, or (SQLite)
// a restarted one with default settings.
func afterKill(t *testing.T, bin, databaseURL, dataDir string, second *kvmdControl) *kvmdControl {
	if second != nil {
		return second
	}
	return startKVMDFlags(t, bin, databaseURL, dataDir, nil)
}

func kill9CreatesDefaults(t *testing.T, bin, databaseURL, dataDir string) time.Duration {
	const (
		creates = 80
		killAt  = 20
	)
	ctx := ctxT(t, 3*time.Minute)
	k, second, agents := defaultsFleet(t, bin, databaseURL, dataDir, 3)
	c := k.client(false)
	var ok, failed atomic.Int64
	var killedAt time.Time
	var killOnce sync.Once
	kill := func() { killOnce.Do(func() { k.kill(); killedAt = time.Now() }) }
	var wg sync.WaitGroup
	for i := range creates {
		wg.Go(func() {
			if _, err := c.CreateVM(ctx, smallVM(fmt.Sprintf("vm-%03d", i)), ""); err != nil {
				failed.Add(1)
				return
			}
			if ok.Add(1) == killAt {
				kill()
			}
		})
	}
	wg.Wait()
	kill()
	if failed.Load() == 0 {
		t.Fatalf("every create finished before the kill; the test killed nothing in flight")
	}
	c2 := afterKill(t, bin, databaseURL, dataDir, second).client(true)
	eventually(t, "control plane and agents agree after the kill, with default settings", func() error {
		return ledger(ctx, c2, agents)
	})
	took := time.Since(killedAt)
	vms, err := c2.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]int{}
	for _, vm := range vms {
		states[vm.ObservedState]++
	}
	t.Logf("kill -9 after %d creates answered (%d cut off); agreement %v after the kill; rows by state %v",
		ok.Load(), failed.Load(), took.Round(time.Millisecond), states)
	if int64(states[api.StateRunning]) < ok.Load()+1 { // +1: the probe
		t.Errorf("%d VMs running, but %d creates were answered 201 before the kill", states[api.StateRunning], ok.Load()+1)
	}
	if states[api.StateMissing] != 0 {
		t.Errorf("%d rows missing: a create cut off before its agent made the VM should leave no row", states[api.StateMissing])
	}
	return took
}

func kill9ForksDefaults(t *testing.T, bin, databaseURL, dataDir string) time.Duration {
	const (
		sources  = 4
		children = 6
	)
	ctx := ctxT(t, 3*time.Minute)
	k, second, agents := defaultsFleet(t, bin, databaseURL, dataDir, 3)
	var srcs []api.VM
	for i := range sources {
		vm, err := k.client(true).CreateVM(ctx, smallVM(fmt.Sprintf("src-%d", i)), "")
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, vm)
	}
	c := k.client(false)
	var answered, cut atomic.Int64
	var killedAt time.Time
	var killOnce sync.Once
	kill := func() { killOnce.Do(func() { k.kill(); killedAt = time.Now() }) }
	var wg sync.WaitGroup
	for i, src := range srcs {
		placement := api.PlacementColocate
		if i%2 == 1 {
			placement = api.PlacementSpread
		}
		wg.Go(func() {
			if _, err := c.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: children, Placement: placement}, ""); err != nil {
				cut.Add(1)
				return
			}
			if answered.Add(1) == 1 {
				kill()
			}
		})
	}
	wg.Wait()
	kill()
	c2 := afterKill(t, bin, databaseURL, dataDir, second).client(true)
	forks := 0
	eventually(t, "every recorded fork completes and control plane and agents agree, with default settings", func() error {
		forks = 0
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
			forks++
		}
		return ledger(ctx, c2, agents)
	})
	took := time.Since(killedAt)
	t.Logf("kill -9 with %d forks answered, %d cut off; %d forks complete and agreement %v after the kill",
		answered.Load(), cut.Load(), forks, took.Round(time.Millisecond))
	if int64(forks) < answered.Load() {
		t.Errorf("%d forks with children after the kill, but %d were answered before it", forks, answered.Load())
	}
	return took
}
