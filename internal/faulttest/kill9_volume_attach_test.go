package faulttest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// vmVolumePath is an agent's attach (PUT) or detach (DELETE) of a volume.
var vmVolumePath = regexp.MustCompile(`^/v1/vms/[^/]+/volumes/[^/]+$`)

// startVolumeCallGate holds the first attach (PUT) or detach (DELETE)
// call of method to the agent, before the agent sees it or after it
// applied it (forward).
func startVolumeCallGate(t *testing.T, agentURL, method string, forward bool) *callGate {
	t.Helper()
	return startCallGate(t, agentURL, forward, func(r *http.Request) bool {
		return r.Method == method && vmVolumePath.MatchString(r.URL.Path)
	})
}

// vmVolumes lists what an agent has on each VM: vm -> "volume/read_only".
type vmVolumes func(ctx context.Context) (map[string][]string, error)

func agentVMVolumes(c *agentapi.Client) vmVolumes {
	return func(ctx context.Context) (map[string][]string, error) {
		vms, err := c.ListVMs(ctx)
		if err != nil {
			return nil, err
		}
		out := map[string][]string{}
		for _, vm := range vms {
			for _, v := range vm.Volumes {
				out[vm.ID] = append(out[vm.ID], fmt.Sprintf("%s/%t", v.ID, v.ReadOnly))
			}
			slices.Sort(out[vm.ID])
		}
		return out, nil
	}
}

// attachmentsAgree checks through the control API that every attachment
// row is settled (attached), that each VM's rows are what its agent has
// on it, that each volume's attached_to matches, and that each host's
// allocation is its VM rows plus its volumes. It returns the first
// disagreement.
func attachmentsAgree(ctx context.Context, c *client.Client, agents map[string]vmVolumes) error {
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	var problems []string
	rows := map[string]map[string][]string{} // host -> vm -> volumes
	alloc := map[string]api.Resources{}
	claimed := map[string][]string{} // volume -> vm
	for _, vm := range vms {
		if rows[vm.Host] == nil {
			rows[vm.Host] = map[string][]string{}
		}
		var vols []string
		for _, v := range vm.Volumes {
			if v.State != api.AttachmentAttached {
				problems = append(problems, fmt.Sprintf("vm %s: volume %s is %s", vm.ID, v.VolumeID, v.State))
			}
			vols = append(vols, fmt.Sprintf("%s/%t", v.VolumeID, v.ReadOnly))
			claimed[v.VolumeID] = append(claimed[v.VolumeID], vm.ID)
		}
		slices.Sort(vols)
		rows[vm.Host][vm.ID] = vols
		if !api.Gone(vm.ObservedState) {
			a := alloc[vm.Host]
			a.VCPUs, a.MemoryMiB, a.DiskMiB = a.VCPUs+vm.VCPUs, a.MemoryMiB+vm.MemoryMiB, a.DiskMiB+vm.DiskMiB
			alloc[vm.Host] = a
		}
	}
	for token := ""; ; {
		page, err := c.ListVolumes(ctx, 1000, token)
		if err != nil {
			return err
		}
		for _, v := range page.Items {
			a := alloc[v.Host]
			a.DiskMiB += v.SizeMiB
			alloc[v.Host] = a
			var to []string
			for _, at := range v.AttachedTo {
				to = append(to, at.VMID)
			}
			slices.Sort(to)
			want := slices.Sorted(slices.Values(claimed[v.ID]))
			if !slices.Equal(to, want) {
				problems = append(problems, fmt.Sprintf("volume %s: attached_to %v, the VMs list it on %v", v.ID, to, want))
			}
		}
		if token = page.NextPageToken; token == "" {
			break
		}
	}
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	for _, h := range hosts {
		if h.Allocated != alloc[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s: allocated %+v, its VM and volume rows add up to %+v", h.Name, h.Allocated, alloc[h.Name]))
		}
		list, ok := agents[h.Name]
		if !ok {
			continue
		}
		onAgent, err := list(ctx)
		if err != nil {
			return fmt.Errorf("list VMs of the agent of %s: %w", h.Name, err)
		}
		for vm, want := range rows[h.Name] {
			if !slices.Equal(onAgent[vm], want) {
				problems = append(problems, fmt.Sprintf("vm %s: rows %v, agent of %s has %v", vm, want, h.Name, onAgent[vm]))
			}
		}
		for vm, got := range onAgent {
			if _, ok := rows[h.Name][vm]; !ok && len(got) > 0 {
				problems = append(problems, fmt.Sprintf("agent of %s has volumes %v on vm %s that has no row", h.Name, got, vm))
			}
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// kvmd control is killed with SIGKILL in the middle of a hot attach or
// detach: after its row was written and either before the agent got the
// call or after the agent applied it. After a restart, the host monitor
// settles the row against the agent: the rows and the agent agree, and
// attach and detach work again.
func TestKill9DuringVolumeAttach(t *testing.T) {
	bin := buildKVMD(t)
	for _, tc := range []struct {
		name, method string
		forward      bool
		attached     bool // the outcome once settled
	}{
		{"attach before the agent call", http.MethodPut, false, false},
		{"attach after the agent applied it", http.MethodPut, true, true},
		{"detach before the agent call", http.MethodDelete, false, false},
		{"detach after the agent applied it", http.MethodDelete, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(t *testing.T, databaseURL, dataDir string) {
				kill9DuringVolumeAttach(t, bin, databaseURL, dataDir, tc.method, tc.forward, tc.attached)
			}
			t.Run("sqlite", func(t *testing.T) { run(t, "", t.TempDir()) })
			t.Run("postgres", func(t *testing.T) { run(t, testenv.PostgresURL(t), "") })
		})
	}
}

func kill9DuringVolumeAttach(t *testing.T, bin, databaseURL, dataDir, method string, forward, wantAttached bool) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
	gate := startVolumeCallGate(t, a.URL, method, forward)
	a.AllowAddress(t, gate.address)
	c := k.client(true)
	if _, err := c.PutHost(ctx, "h1", api.HostPut{Address: gate.address}); err != nil {
		t.Fatal(err)
	}
	agents := map[string]vmVolumes{"h1": agentVMVolumes(a.Client)}
	var vm api.VM
	eventually(t, "the host is synced and takes a VM", func() error {
		var err error
		vm, err = k.client(false).CreateVM(ctx, smallVM("app"), "")
		return err
	})
	vol, err := c.CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 64, Host: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	if method == http.MethodDelete {
		if _, err := c.AttachVolume(ctx, vm.ID, api.VMVolumeAttach{Volume: vol.ID}); err != nil {
			t.Fatal(err)
		}
	}

	answered := make(chan error, 1)
	go func() {
		if method == http.MethodPut {
			_, err := k.client(false).AttachVolume(ctx, vm.ID, api.VMVolumeAttach{Volume: vol.ID})
			answered <- err
			return
		}
		answered <- k.client(false).DetachVolume(ctx, vm.ID, vol.ID)
	}()
	select {
	case <-gate.reached:
	case err := <-answered:
		t.Fatalf("the call answered (%v) before the gate held it", err)
	case <-ctx.Done():
		t.Fatal("the call never reached the agent's gate")
	}
	k.kill()
	if err := <-answered; err == nil {
		t.Fatal("the call answered success although kvmd was killed before it finished")
	}

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	eventually(t, "the restarted control plane settles the attachment", func() error {
		if err := attachmentsAgree(ctx, c2, agents); err != nil {
			return err
		}
		got, err := c2.GetVM(ctx, vm.ID)
		if err != nil {
			return err
		}
		if attached := len(got.Volumes) == 1; attached != wantAttached {
			return fmt.Errorf("vm %s has volumes %+v; want attached %t", vm.ID, got.Volumes, wantAttached)
		}
		return nil
	})
	// Attach and detach work again, and the volume can go.
	if _, err := c2.AttachVolume(ctx, vm.ID, api.VMVolumeAttach{Volume: "data"}); err != nil {
		t.Fatalf("attach after the restart: %v", err)
	}
	if err := c2.DetachVolume(ctx, vm.ID, "data"); err != nil {
		t.Fatalf("detach after the restart: %v", err)
	}
	if err := c2.DeleteVolume(ctx, "data"); err != nil {
		t.Fatalf("delete the volume after the restart: %v", err)
	}
	if err := attachmentsAgree(ctx, c2, agents); err != nil {
		t.Error(err)
	}
}

// The agent (kvmd agent, sim driver) is killed with SIGKILL while hot
// attaches and detaches run against it, then started again on its state
// directory: afterwards every attachment row is settled and each VM's
// rows are what the agent has, and the volumes attach and detach again.
func TestKill9AgentDuringVolumeAttach(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite", func(t *testing.T) { kill9AgentDuringVolumeAttach(t, bin, "", t.TempDir()) })
	t.Run("postgres", func(t *testing.T) { kill9AgentDuringVolumeAttach(t, bin, testenv.PostgresURL(t), "") })
}

func kill9AgentDuringVolumeAttach(t *testing.T, bin, databaseURL, dataDir string) {
	const (
		pairs   = 6  // VM and volume pairs, each toggled by one worker
		rounds  = 40 // attach+detach rounds per worker, at most
		killAt  = 30 // successful calls before the kill
		settled = 2  // rounds after the restart
	)
	ctx := ctxT(t, 3*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	ag := startKVMDAgent(t, bin)
	c := k.client(true)
	if _, err := c.PutHost(ctx, "h1", api.HostPut{Address: "http://" + ag.listen}); err != nil {
		t.Fatal(err)
	}
	agents := map[string]vmVolumes{"h1": agentVMVolumes(ag.client)}
	vms := make([]api.VM, pairs)
	for i := range pairs {
		eventually(t, "the host is synced and takes a VM", func() error {
			var err error
			vms[i], err = k.client(false).CreateVM(ctx, smallVM(fmt.Sprintf("app-%d", i)), "")
			return err
		})
		if _, err := c.CreateVolume(ctx, api.VolumeCreate{Name: fmt.Sprintf("data-%d", i), SizeMiB: 16, Host: "h1"}); err != nil {
			t.Fatal(err)
		}
	}

	var ok, failed atomic.Int64
	killed := make(chan struct{})
	var killOnce sync.Once
	kill := func() { killOnce.Do(func() { ag.kill(); close(killed) }) }
	noRetry := k.client(false)
	var wg sync.WaitGroup
	for i := range pairs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vol := fmt.Sprintf("data-%d", i)
			for range rounds {
				select {
				case <-killed:
					return
				default:
				}
				for _, call := range []func() error{
					func() error {
						_, err := noRetry.AttachVolume(ctx, vms[i].ID, api.VMVolumeAttach{Volume: vol})
						return err
					},
					func() error { return noRetry.DetachVolume(ctx, vms[i].ID, vol) },
				} {
					if err := call(); err != nil {
						failed.Add(1)
						continue
					}
					if ok.Add(1) == killAt {
						kill()
					}
				}
			}
		}()
	}
	wg.Wait()
	kill()
	t.Logf("before the kill: %d attach/detach calls succeeded, %d failed", ok.Load(), failed.Load())
	if ok.Load() < killAt {
		t.Fatalf("only %d calls succeeded before the workers ended; the kill came after all of them", ok.Load())
	}

	ag.start(t)
	eventually(t, "rows and the restarted agent agree", func() error { return attachmentsAgree(ctx, c, agents) })
	for i := range pairs {
		vol := fmt.Sprintf("data-%d", i)
		for range settled {
			if _, err := c.AttachVolume(ctx, vms[i].ID, api.VMVolumeAttach{Volume: vol}); err != nil {
				t.Fatalf("attach %s after the agent restart: %v", vol, err)
			}
			if err := c.DetachVolume(ctx, vms[i].ID, vol); err != nil {
				t.Fatalf("detach %s after the agent restart: %v", vol, err)
			}
		}
	}
	if err := attachmentsAgree(ctx, c, agents); err != nil {
		t.Error(err)
	}
}
