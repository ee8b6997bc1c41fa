package faulttest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// kvmd control is killed with SIGKILL while forks of VMs with a volume
// run (children spill to the other host, whose agent pulls their
// volumes), then restarted on the same database: every fork completes,
// each child with one volume of its own on its host, and the volume rows,
// the agents' volumes and the hosts' allocations (VMs plus volumes) agree.
func TestKill9DuringForksWithVolumes(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite", func(t *testing.T) { kill9DuringForksWithVolumes(t, bin, "", t.TempDir()) })
	t.Run("postgres", func(t *testing.T) { kill9DuringForksWithVolumes(t, bin, testenv.PostgresURL(t), "") })
}

func kill9DuringForksWithVolumes(t *testing.T, bin, databaseURL, dataDir string) {
	const (
		sources  = 4
		children = 3
	)
	ctx := ctxT(t, 3*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	agents := map[string]*testenv.Agent{}
	for i := range 2 {
		// host-0 takes the sources and a few children; the rest spill.
		opts := testenv.AgentOptions{}
		if i == 0 {
			opts = testenv.AgentOptions{VCPUs: 16, MemoryMiB: 8 << 10, DiskMiB: 1 << 20}
		}
		a := testenv.StartAgent(t, opts)
		name := fmt.Sprintf("host-%d", i)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: a.Address}); err != nil {
			t.Fatal(err)
		}
		agents[name] = a
	}
	var srcs []api.VM
	eventually(t, "hosts synced", func() error {
		_, err := k.client(false).CreateVolume(ctx, api.VolumeCreate{Name: "probe", SizeMiB: 1, Host: "host-0"})
		return err
	})
	for i := range sources {
		name := fmt.Sprintf("data-%d", i)
		if _, err := k.client(true).CreateVolume(ctx, api.VolumeCreate{Name: name, SizeMiB: 64, Host: "host-0"}); err != nil {
			t.Fatal(err)
		}
		in := smallVM(fmt.Sprintf("src-%d", i))
		in.Volumes = []api.VMVolume{{Volume: name}}
		vm, err := k.client(true).CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, vm)
	}
	c := k.client(false)
	var answered atomic.Int64
	var killOnce sync.Once
	var wg sync.WaitGroup
	for _, src := range srcs {
		wg.Go(func() {
			if _, err := c.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: children, Placement: api.PlacementColocate}, ""); err != nil {
				return
			}
			if answered.Add(1) == 1 {
				killOnce.Do(k.kill)
			}
		})
	}
	wg.Wait()
	killOnce.Do(k.kill)
	t.Logf("before the kill: %d of %d forks answered", answered.Load(), sources)

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	lister := map[string]agentLister{}
	for name, a := range agents {
		lister[name] = realAgent(a)
	}
	eventually(t, "every fork completes after the restart, with one volume per child, and all agree", func() error {
		vms, err := c2.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			return err
		}
		forks := map[string]bool{}
		for _, vm := range vms {
			if vm.ForkID != "" {
				forks[vm.ForkID] = true
			}
		}
		for id := range forks {
			f, err := c2.GetFork(ctx, id)
			if err != nil {
				return err
			}
			if f.Phase != api.ForkReady || len(f.Children) != children {
				return fmt.Errorf("fork %s: phase %s with %d of %d children (%s)", f.ID, f.Phase, len(f.Children), children, f.Error)
			}
			for _, ch := range f.Children {
				vm, err := c2.GetVM(ctx, ch.ID)
				if err != nil {
					return err
				}
				if len(vm.Volumes) != 1 {
					return fmt.Errorf("fork %s child %s has volumes %+v, want one", f.ID, ch.Name, vm.Volumes)
				}
			}
		}
		return forkVolumeLedger(ctx, c2.ListVolumes, c2.AllHosts, vms, agents, lister)
	})
}

// forkVolumeLedger is ledger with volumes: each host's allocation is its VM
// rows plus its volume rows, no volume is creating or deleting, and each
// agent has exactly the volumes whose rows name its host.
func forkVolumeLedger(ctx context.Context, listVolumes func(context.Context, int, string) (api.List[api.Volume], error),
	allHosts func(context.Context) ([]api.Host, error), vms []api.VM, agents map[string]*testenv.Agent, lister map[string]agentLister) error {
	var vols []api.Volume
	token := ""
	for {
		page, err := listVolumes(ctx, 1000, token)
		if err != nil {
			return err
		}
		vols = append(vols, page.Items...)
		if token = page.NextPageToken; token == "" {
			break
		}
	}
	hosts, err := allHosts(ctx)
	if err != nil {
		return err
	}
	sum := map[string]int64{}
	rows := map[string][]string{}
	for _, vm := range vms {
		if vm.ObservedState == api.StateCreating {
			return fmt.Errorf("vm %s (%s) is still creating", vm.ID, vm.Name)
		}
		if !api.Gone(vm.ObservedState) {
			sum[vm.Host] += vm.DiskMiB
		}
	}
	for _, v := range vols {
		if v.State != "ready" {
			return fmt.Errorf("volume %s (%s) on %s is %s", v.ID, v.Name, v.Host, v.State)
		}
		sum[v.Host] += v.SizeMiB
		rows[v.Host] = append(rows[v.Host], v.ID)
	}
	var problems []string
	for _, h := range hosts {
		if h.Allocated.DiskMiB != sum[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s: %d MiB of disk allocated, its VM and volume rows add up to %d", h.Name, h.Allocated.DiskMiB, sum[h.Name]))
		}
		a, ok := agents[h.Name]
		if !ok {
			continue
		}
		vs, err := a.Client.ListVolumes(ctx)
		if err != nil {
			return err
		}
		var got []string
		for _, v := range vs {
			got = append(got, v.ID)
		}
		want := rows[h.Name]
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			problems = append(problems, fmt.Sprintf("host %s: agent has volumes %v, rows say %v", h.Name, got, want))
		}
		ids, err := lister[h.Name](ctx)
		if err != nil {
			return err
		}
		var running []string
		for _, vm := range vms {
			if vm.Host == h.Name && !api.Gone(vm.ObservedState) {
				running = append(running, vm.ID)
			}
		}
		slices.Sort(ids)
		slices.Sort(running)
		if !slices.Equal(ids, running) {
			problems = append(problems, fmt.Sprintf("host %s: agent runs %v, rows hold %v", h.Name, ids, running))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}
