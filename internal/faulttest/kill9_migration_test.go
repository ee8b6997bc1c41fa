package faulttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// migrationGate sits between kvmd control and a sim agent. The first call
// that hold matches is held there (after the agent answered it when
// forward is set, the answer never reaching control) and reached is
// closed; it is released only when its caller goes away (the kill) or the
// test ends. Every other call passes, migration streams included.
type migrationGate struct {
	reached chan struct{}
	stop    chan struct{}
	held    atomic.Bool
	address string
}

// holdRule says which call a gate holds: its method and path suffix, and
// for a forwarded call, a string its answer must contain ("" for any).
type holdRule struct {
	method, suffix string
	forward        bool
	answer         string
}

func startMigrationGate(t *testing.T, agentURL string, rule *holdRule) *migrationGate {
	t.Helper()
	g := &migrationGate{reached: make(chan struct{}), stop: make(chan struct{})}
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	hold := func(r *http.Request) {
		close(g.reached)
		select {
		case <-r.Context().Done():
		case <-g.stop:
		}
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rule == nil || g.held.Load() || r.Method != rule.method || !strings.HasSuffix(r.URL.Path, rule.suffix) {
			proxy.ServeHTTP(w, r)
			return
		}
		if !rule.forward {
			if g.held.CompareAndSwap(false, true) {
				_, _ = io.Copy(io.Discard, r.Body)
				hold(r)
				return
			}
			proxy.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		proxy.ServeHTTP(rec, r.WithContext(context.WithoutCancel(r.Context())))
		if (rule.answer == "" || bytes.Contains(rec.Body.Bytes(), []byte(rule.answer))) && g.held.CompareAndSwap(false, true) {
			hold(r)
			return
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}))
	t.Cleanup(func() { close(g.stop); srv.Close() })
	g.address = srv.URL
	return g
}

// kvmd control is killed with SIGKILL at each step of a migration from h1
// to h2; after a restart its host monitor finishes or undoes it: exactly
// one agent runs the VM, its row names that host, capacity is held there
// only, and no migration is left.
func TestKill9DuringMigration(t *testing.T) {
	bin := buildKVMD(t)
	for _, tc := range []struct {
		name     string
		source   *holdRule // held on the source's gate
		target   *holdRule // held on the target's gate
		wantHost string
	}{
		{name: "after the target reservation", target: &holdRule{method: http.MethodPut, suffix: "/incoming"}, wantHost: "h1"},
		{name: "during the migration", source: &holdRule{method: http.MethodPost, suffix: "/migrate", forward: true}, wantHost: "h2"},
		{name: "after completion before the switch", source: &holdRule{method: http.MethodGet, suffix: "/migration", forward: true,
			answer: `"state":"completed"`}, wantHost: "h2"},
		{name: "after the switch before the source delete", source: &holdRule{method: http.MethodDelete, suffix: "", forward: false},
			wantHost: "h2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Run("sqlite", func(t *testing.T) {
				kill9DuringMigration(t, bin, "", t.TempDir(), tc.source, tc.target, tc.wantHost, false)
			})
			t.Run("postgres", func(t *testing.T) {
				kill9DuringMigration(t, bin, testenv.PostgresURL(t), "", tc.source, tc.target, tc.wantHost, false)
			})
			// A VM with a volume: the volume's row follows the VM's and
			// exactly the agent of its host has it.
			t.Run("volume", func(t *testing.T) {
				kill9DuringMigration(t, bin, "", t.TempDir(), tc.source, tc.target, tc.wantHost, true)
			})
		})
	}
}

// migvolLedger is ledger for VMs with volumes: each host allocates what
// its VM rows and its volume rows add up to, each agent has exactly the
// VMs and the volumes whose rows name its host, and each volume of VM id
// is on the VM's host.
func migvolLedger(ctx context.Context, c *client.Client, agents map[string]*testenv.Agent, id string) error {
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	vols, err := c.ListVolumes(ctx, 0, "")
	if err != nil {
		return err
	}
	sum := map[string]api.Resources{}
	vmRows, volRows := map[string][]string{}, map[string][]string{}
	var problems []string
	vmHost := ""
	for _, vm := range vms {
		s := sum[vm.Host]
		s.VCPUs, s.MemoryMiB, s.DiskMiB = s.VCPUs+vm.VCPUs, s.MemoryMiB+vm.MemoryMiB, s.DiskMiB+vm.DiskMiB
		sum[vm.Host] = s
		vmRows[vm.Host] = append(vmRows[vm.Host], vm.ID)
		if vm.ID == id {
			vmHost = vm.Host
		}
	}
	for _, v := range vols.Items {
		s := sum[v.Host]
		s.DiskMiB += v.SizeMiB
		sum[v.Host] = s
		volRows[v.Host] = append(volRows[v.Host], v.ID)
		if v.State != api.VolumeReady || v.Host != vmHost {
			problems = append(problems, fmt.Sprintf("volume %s is %s on %s; its vm %s is on %s", v.ID, v.State, v.Host, id, vmHost))
		}
	}
	for _, h := range hosts {
		if h.Allocated != sum[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s allocates %+v, its vm and volume rows add up to %+v", h.Name, h.Allocated, sum[h.Name]))
		}
		a := agents[h.Name]
		onAgent, err := a.Client.ListVMs(ctx)
		if err != nil {
			return err
		}
		agentVols, err := a.Client.ListVolumes(ctx)
		if err != nil {
			return err
		}
		var gotVMs, gotVols []string
		for _, v := range onAgent {
			gotVMs = append(gotVMs, v.ID)
		}
		for _, v := range agentVols {
			gotVols = append(gotVols, v.ID)
		}
		for _, p := range [][2][]string{{gotVMs, vmRows[h.Name]}, {gotVols, volRows[h.Name]}} {
			got, want := p[0], p[1]
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				problems = append(problems, fmt.Sprintf("host %s: agent has %v, rows name %v", h.Name, got, want))
			}
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func kill9DuringMigration(t *testing.T, bin, databaseURL, dataDir string, sourceRule, targetRule *holdRule, wantHost string, withVolume bool) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	agents := map[string]agentLister{}
	raw := map[string]*testenv.Agent{}
	gates := map[string]*migrationGate{}
	for name, rule := range map[string]*holdRule{"h1": sourceRule, "h2": targetRule} {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
		g := startMigrationGate(t, a.URL, rule)
		a.AllowAddress(t, g.address)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: g.address}); err != nil {
			t.Fatal(err)
		}
		agents[name], gates[name], raw[name] = realAgent(a), g, a
	}
	create := api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}
	check := func(c *client.Client) error { return ledger(ctx, c, agents) }
	if withVolume {
		var vol api.Volume
		eventually(t, "the hosts are synced and take a volume", func() error {
			var err error
			vol, err = k.client(false).CreateVolume(ctx, api.VolumeCreate{Name: "db-data", SizeMiB: 256, Host: "h1"})
			return err
		})
		create.Volumes = []api.VMVolume{{Volume: vol.ID}}
	}
	var vm api.VM
	eventually(t, "the hosts are synced and take a VM", func() error {
		var err error
		vm, err = k.client(false).CreateVM(ctx, create, "")
		return err
	})
	if withVolume {
		check = func(c *client.Client) error { return migvolLedger(ctx, c, raw, vm.ID) }
	}
	gate := gates["h1"]
	if sourceRule == nil {
		gate = gates["h2"]
	}
	answered := make(chan error, 1)
	go func() {
		_, err := k.client(false).MigrateVM(ctx, vm.ID, "h2")
		answered <- err
	}()
	select {
	case <-gate.reached:
	case err := <-answered:
		t.Fatalf("the migration answered (%v) before the gate held it", err)
	case <-ctx.Done():
		t.Fatal("the migration never reached the gate")
	}
	k.kill()
	if err := <-answered; err == nil {
		t.Fatal("the migration answered success although kvmd was killed before it finished")
	}

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	eventually(t, "the restarted control plane settles the migration", func() error {
		if err := check(c2); err != nil {
			return err
		}
		row, err := c2.GetVM(ctx, vm.ID)
		if err != nil {
			return err
		}
		if row.Migration != nil {
			return fmt.Errorf("vm %s still migrating: %+v", vm.ID, *row.Migration)
		}
		if row.Host != wantHost || row.ObservedState != api.StateRunning {
			return fmt.Errorf("vm %s is %s on %s; want running on %s", vm.ID, row.ObservedState, row.Host, wantHost)
		}
		return nil
	})
	// Migrations work again after the restart.
	other := map[string]string{"h1": "h2", "h2": "h1"}[wantHost]
	if _, err := c2.MigrateVM(ctx, vm.ID, other); err != nil {
		t.Fatalf("migrate after the restart: %v", err)
	}
	if err := check(c2); err != nil {
		t.Error(err)
	}
}
