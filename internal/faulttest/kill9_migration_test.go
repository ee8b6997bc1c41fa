package faulttest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
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
			t.Run("sqlite", func(t *testing.T) { kill9DuringMigration(t, bin, "", t.TempDir(), tc.source, tc.target, tc.wantHost) })
			t.Run("postgres", func(t *testing.T) {
				kill9DuringMigration(t, bin, testenv.PostgresURL(t), "", tc.source, tc.target, tc.wantHost)
			})
		})
	}
}

func kill9DuringMigration(t *testing.T, bin, databaseURL, dataDir string, sourceRule, targetRule *holdRule, wantHost string) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	agents := map[string]agentLister{}
	gates := map[string]*migrationGate{}
	for name, rule := range map[string]*holdRule{"h1": sourceRule, "h2": targetRule} {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
		g := startMigrationGate(t, a.URL, rule)
		a.AllowAddress(t, g.address)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: g.address}); err != nil {
			t.Fatal(err)
		}
		agents[name], gates[name] = realAgent(a), g
	}
	var vm api.VM
	eventually(t, "the hosts are synced and take a VM", func() error {
		var err error
		vm, err = k.client(false).CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}, "")
		return err
	})
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
		if err := ledger(ctx, c2, agents); err != nil {
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
	if err := ledger(ctx, c2, agents); err != nil {
		t.Error(err)
	}
}
