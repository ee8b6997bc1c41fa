package control_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// drainFleet makes h1 hold six VMs, two of them in groups capped at one
// VM per host whose other members are on h2 (db) and h3 (web): a drain of
// h1 must send db-0 to h3 and web-0 to h2.
func drainFleet(ctx context.Context, t *testing.T, f migrationFleet) []api.VM {
	t.Helper()
	c := f.c.Client
	var onH1 []api.VM
	create := func(name, host, group string) api.VM {
		in := api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: host}
		if group != "" {
			in.Constraints = &api.Constraints{Group: group, MaxPerDomain: 1}
		}
		vm, err := c.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatalf("create %s on %s: %v", name, host, err)
		}
		return vm
	}
	onH1 = append(onH1, create("db-0", "h1", "db"), create("web-0", "h1", "web"))
	create("db-1", "h2", "db")
	create("web-1", "h3", "web")
	for i := range 4 {
		onH1 = append(onH1, create(fmt.Sprintf("app-%d", i), "h1", ""))
	}
	// One of them is stopped: it moves cold.
	if _, err := c.UpdateVM(ctx, onH1[5].ID, api.VMPatch{PowerState: ptr(api.PowerStopped)}); err != nil {
		t.Fatal(err)
	}
	return onH1
}

// drained checks that h1 is drained, that its VMs all run (or are
// stopped) elsewhere with one copy each, and that the group caps held.
func drained(ctx context.Context, t *testing.T, f migrationFleet, vms []api.VM) {
	t.Helper()
	h, err := f.c.Client.GetHost(ctx, "h1")
	if err != nil {
		t.Fatal(err)
	}
	if h.Drain.State != api.DrainDrained || h.Drain.Remaining != 0 || h.Drain.Total != 6 || h.Drain.Moved != 6 || len(h.Drain.Failed) != 0 {
		t.Fatalf("h1 drain = %+v; want drained, 6 of 6 moved, none failed", h.Drain)
	}
	if listed := drainListed(ctx, t, f, "h1"); !reflect.DeepEqual(listed, h.Drain) {
		t.Fatalf("GET /v1/hosts shows h1's drain as %+v, GET /v1/hosts/h1 as %+v", listed, h.Drain)
	}
	hosts := map[string]string{}
	for _, vm := range vms {
		if err := f.oneCopy(ctx, vm.ID); err != nil {
			t.Error(err)
		}
		got, err := f.c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		hosts[got.Name] = got.Host
		want := api.StateRunning
		if vm.Name == "app-3" {
			want = api.StateStopped
		}
		if got.Host == "h1" || got.ObservedState != want {
			t.Errorf("vm %s is %s on %s; want %s off h1", got.Name, got.ObservedState, got.Host, want)
		}
	}
	if hosts["db-0"] != "h3" || hosts["web-0"] != "h2" {
		t.Errorf("db-0 went to %s and web-0 to %s; the caps of one per host allow only h3 and h2", hosts["db-0"], hosts["web-0"])
	}
	checkLedger(t, f.c.Store)
	for _, g := range []string{"default/db", "default/web"} {
		counts, err := f.c.Store.GroupCounts(ctx, g, "host")
		if err != nil {
			t.Fatal(err)
		}
		for d, n := range counts {
			if n > 1 {
				t.Errorf("group %s has %d VMs on %s", g, n, d)
			}
		}
	}
}

func TestDrainMovesEveryVMKeepingCaps(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 3, 16384, testenv.ControlOptions{})
		vms := drainFleet(ctx, t, f)
		h, err := f.c.Client.DrainHost(ctx, "h1")
		if err != nil {
			t.Fatalf("drain h1: %v", err)
		}
		if h.Drain.State != api.DrainDraining || h.Drain.Total != 6 {
			t.Fatalf("drain answer %+v; want draining with 6 VMs", h.Drain)
		}
		if _, err := noRetry(f.c).CreateVM(ctx, api.VMCreate{Name: "new", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: "h1"}, ""); apiCode(err) != api.CodeNoCapacity {
			t.Fatalf("create on a draining host: %v; want 409 no_capacity", err)
		}
		eventually(t, "h1 drained", func() bool {
			h, err := f.c.Client.GetHost(ctx, "h1")
			return err == nil && h.Drain.State != api.DrainDraining
		})
		drained(ctx, t, f, vms)
		h, err = f.c.Client.UndrainHost(ctx, "h1")
		if err != nil || h.Drain.State != api.DrainNone {
			t.Fatalf("undrain h1: %+v, %v", h.Drain, err)
		}
		if _, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: "new", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: "h1"}, ""); err != nil {
			t.Fatalf("create on an undrained host: %v", err)
		}
	})
}

// A drain whose control plane stops mid-way (a migration stopped at its
// reservation, and the process gone) is resumed by the next one.
func TestDrainResumesAfterRestart(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		var stopped atomic.Bool
		hooks := &control.Hooks{MigrationStep: func(_ context.Context, _, step string) error {
			if step == control.MigrationStepMoving && stopped.CompareAndSwap(false, true) {
				return errors.New("control plane gone")
			}
			return nil
		}}
		dataDir := t.TempDir()
		f := startMigrationFleet(t, dbURL, 3, 16384, testenv.ControlOptions{Hooks: hooks, DataDir: dataDir})
		vms := drainFleet(ctx, t, f)
		if _, err := f.c.Client.DrainHost(ctx, "h1"); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the drain stops at its first migration", stopped.Load)
		f.c.Stop()
		f.c = testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: dataDir})
		eventually(t, "the restarted control plane finishes the drain", func() bool {
			h, err := f.c.Client.GetHost(ctx, "h1")
			return err == nil && h.Drain.State != api.DrainDraining
		})
		drained(ctx, t, f, vms)
	})
}

// drainListed is host name's drain as the host list (GET /v1/hosts) shows it.
func drainListed(ctx context.Context, t *testing.T, f migrationFleet, name string) api.HostDrain {
	t.Helper()
	hosts, err := f.c.Client.AllHosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.Name == name {
			return h.Drain
		}
	}
	t.Fatalf("GET /v1/hosts does not list host %s", name)
	return api.HostDrain{}
}

// A drain that cannot move every VM ends incomplete, and the host list
// shows the same progress as the host's own answer: what moved, what
// remains and why.
func TestDrainProgressInHostList(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 2, 16384, testenv.ControlOptions{})
		c := f.c.Client
		for _, in := range []api.VMCreate{
			{Name: "db-0", Host: "h1", Constraints: &api.Constraints{Group: "db", MaxPerDomain: 1}},
			{Name: "db-1", Host: "h2", Constraints: &api.Constraints{Group: "db", MaxPerDomain: 1}},
			{Name: "app", Host: "h1"},
		} {
			in.Image, in.VCPUs, in.MemoryMiB, in.DiskMiB = "sim", 1, 512, 1024
			if _, err := c.CreateVM(ctx, in, ""); err != nil {
				t.Fatalf("create %s: %v", in.Name, err)
			}
		}
		if listed := drainListed(ctx, t, f, "h1"); listed.State != api.DrainNone || listed.Remaining != 0 || listed.Failed == nil {
			t.Fatalf("h1 in service listed with drain %+v; want none (and an empty failure list)", listed)
		}
		if _, err := c.DrainHost(ctx, "h1"); err != nil {
			t.Fatal(err)
		}
		var h api.Host
		eventually(t, "the drain pass ends", func() bool {
			var err error
			h, err = c.GetHost(ctx, "h1")
			return err == nil && h.Drain.State != api.DrainDraining
		})
		// db-0 has nowhere to go: h2 holds its group's one VM.
		if h.Drain.State != api.DrainIncomplete || h.Drain.Total != 2 || h.Drain.Moved != 1 || h.Drain.Remaining != 1 || len(h.Drain.Failed) != 1 {
			t.Fatalf("h1 drain = %+v; want incomplete, 1 of 2 moved, 1 remaining that failed", h.Drain)
		}
		if listed := drainListed(ctx, t, f, "h1"); !reflect.DeepEqual(listed, h.Drain) {
			t.Fatalf("GET /v1/hosts shows h1's drain as %+v, GET /v1/hosts/h1 as %+v", listed, h.Drain)
		}
	})
}
