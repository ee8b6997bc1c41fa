package control_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// warmShape is the shape the warm pool tests keep warm.
var warmShape = api.WarmPoolTarget{Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024}

func warmTarget(size int) []api.WarmPoolTarget {
	t := warmShape
	t.Size = size
	return []api.WarmPoolTarget{t}
}

func warmVM(name string) api.VMCreate {
	return api.VMCreate{Name: name, Image: warmShape.Image, VCPUs: warmShape.VCPUs, MemoryMiB: warmShape.MemoryMiB, DiskMiB: warmShape.DiskMiB}
}

func startSimAgent(t *testing.T) *testenv.Agent {
	return testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: 8, MemoryMiB: 16384, DiskMiB: 102400})
}

// agentTarget is the agent's target size for the warm shape (0 if none).
func agentTarget(t *testing.T, a *testenv.Agent) int {
	t.Helper()
	pool, err := a.Client.Pool(context.Background())
	if err != nil {
		t.Fatalf("GET /v1/pool of the agent: %v", err)
	}
	for _, p := range pool {
		if p.Image == warmShape.Image && p.VCPUs == warmShape.VCPUs && p.MemoryMiB == warmShape.MemoryMiB && p.DiskMiB == warmShape.DiskMiB {
			return p.Size
		}
	}
	return 0
}

// hostReady is the ready count the control API shows for the warm shape.
func hostReady(t *testing.T, c *testenv.Control, host string) int {
	t.Helper()
	h, err := c.Client.GetHost(context.Background(), host)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range h.WarmPool {
		if p.Image == warmShape.Image && p.VCPUs == warmShape.VCPUs && p.MemoryMiB == warmShape.MemoryMiB && p.DiskMiB == warmShape.DiskMiB {
			return p.Ready
		}
	}
	return -1
}

// TestWarmPoolTargetsPushedAndCountsReported: warm_pool is pushed to the
// agent at registration, the host monitor reports the ready counts and
// pushes the targets again when the agent lost them, a matching create
// starts warm and another shape cold, and a PUT without warm_pool clears
// the agent's targets.
func TestWarmPoolTargetsPushedAndCountsReported(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		ag := startSimAgent(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		h, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: warmTarget(2)})
		if err != nil {
			t.Fatal(err)
		}
		if len(h.WarmPool) != 1 || h.WarmPool[0].Size != 2 {
			t.Fatalf("warm_pool in the PUT answer = %+v, want the target of size 2", h.WarmPool)
		}
		if got := agentTarget(t, ag); got != 2 {
			t.Fatalf("agent target after registration = %d, want 2", got)
		}
		eventually(t, "GET /v1/hosts/h1 shows 2 ready warm VMs", func() bool { return hostReady(t, c, "h1") == 2 })
		hosts, err := c.Client.AllHosts(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(hosts) != 1 || len(hosts[0].WarmPool) != 1 || hosts[0].WarmPool[0].Ready != 2 {
			t.Fatalf("GET /v1/hosts warm_pool = %+v, want one target with 2 ready", hosts)
		}

		warm, err := c.Client.CreateVM(ctx, warmVM("warm-1"), "")
		if err != nil {
			t.Fatal(err)
		}
		if warm.StartedFrom != api.StartedWarm {
			t.Errorf("create of the warm shape: started_from = %q, want warm", warm.StartedFrom)
		}
		cold, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "cold-1", Image: "sim", VCPUs: 2, MemoryMiB: 512, DiskMiB: 1024}, "")
		if err != nil {
			t.Fatal(err)
		}
		if cold.StartedFrom != api.StartedCold {
			t.Errorf("create of another shape: started_from = %q, want cold", cold.StartedFrom)
		}
		got, err := c.Client.GetVM(ctx, warm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.StartedFrom != api.StartedWarm {
			t.Errorf("GET of the warm VM: started_from = %q, want warm (stored on the row)", got.StartedFrom)
		}
		row, err := c.Store.GetVM(ctx, warm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if row.StartedFrom != api.StartedWarm {
			t.Errorf("VM row started_from = %q, want warm", row.StartedFrom)
		}
		// The warm VM's NIC keeps the MAC it booted with in the pool (06:,
		// never a control-derived 02: one): the API and vm_nics, whose
		// unique index covers it, say so.
		if len(got.NetworkInterfaces) != 1 || !strings.HasPrefix(got.NetworkInterfaces[0].MACAddress, "06:") {
			t.Errorf("warm VM NICs = %+v; want one NIC with the warm VM's 06: MAC", got.NetworkInterfaces)
		} else {
			live, err := c.Store.LiveNICs(ctx)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, n := range live {
				found = found || (n.VMID == warm.ID && n.MACAddress == got.NetworkInterfaces[0].MACAddress)
			}
			if !found {
				t.Errorf("vm_nics has no row of %s with MAC %s: %+v", warm.ID, got.NetworkInterfaces[0].MACAddress, live)
			}
		}

		// An agent that lost its targets (replaced, state wiped) gets them back.
		if _, err := ag.Client.SetPool(ctx, "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{}}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the host monitor pushes the targets to the agent again", func() bool { return agentTarget(t, ag) == 2 })

		// PUT is a full replace: no warm_pool clears the targets everywhere.
		h, err = c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address})
		if err != nil {
			t.Fatal(err)
		}
		if len(h.WarmPool) != 0 {
			t.Errorf("warm_pool after a PUT without it = %+v, want none", h.WarmPool)
		}
		if got := agentTarget(t, ag); got != 0 {
			t.Errorf("agent target after a PUT without warm_pool = %d, want 0", got)
		}

		// Deregistering a host empties its agent's warm pool.
		if _, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: warmTarget(1)}); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{warm.ID, cold.ID} {
			if err := c.Client.DeleteVM(ctx, id); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Client.DeleteHost(ctx, "h1"); err != nil {
			t.Fatal(err)
		}
		if got := agentTarget(t, ag); got != 0 {
			t.Errorf("agent target after the host was deregistered = %d, want 0", got)
		}
	})
}

func TestWarmPoolRefused(t *testing.T) {
	ctx := ctxT(t)
	ag := startSimAgent(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	_, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: append(warmTarget(1), warmTarget(2)...)})
	if apiCode(err) != api.CodeInvalid || !strings.Contains(err.Error(), "warm_pool[1] repeats warm_pool[0]") {
		t.Fatalf("PUT with a repeated shape: %v, want invalid naming warm_pool[1]", err)
	}
	// Targets the agent refuses save nothing: the host is not registered.
	bad := warmTarget(1)
	bad[0].Image = "no-such-image"
	_, err = c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: bad})
	if apiCode(err) != api.CodeInvalid || !strings.Contains(err.Error(), "no-such-image") {
		t.Fatalf("PUT with an image the agent lacks: %v, want invalid naming the image", err)
	}
	if _, err := c.Client.GetHost(ctx, "h1"); apiCode(err) != api.CodeNotFound {
		t.Fatalf("host after a refused warm pool: %v, want not_found (nothing saved)", err)
	}
}

// TestWarmPreference: with two equal hosts the name decides (a); a ready
// warm VM of the request's shape on b makes b win, and the placement says
// so. Once b is loaded beyond the margin, its warm VM no longer wins.
func TestWarmPreference(t *testing.T) {
	ctx := ctxT(t)
	agA, agB := startSimAgent(t), startSimAgent(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "a", agA.Address)
	req := api.PlacementRequest{Image: warmShape.Image, VCPUs: warmShape.VCPUs, MemoryMiB: warmShape.MemoryMiB, DiskMiB: warmShape.DiskMiB}

	// Equal hosts, no warm VMs: the name decides.
	c.RegisterHost(t, "b", agB.Address)
	dry, err := c.Client.Place(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Host != "a" || dry.Note != "" {
		t.Fatalf("dry run without warm VMs: host %s note %q, want a and no note", dry.Host, dry.Note)
	}

	if _, err := c.Client.PutHost(ctx, "b", api.HostPut{Address: agB.Address, WarmPool: warmTarget(1)}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "host b reports its warm VM ready", func() bool { return hostReady(t, c, "b") == 1 })
	dry, err = c.Client.Place(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Host != "b" || !strings.Contains(dry.Note, "warm preference decided") {
		t.Fatalf("dry run with a warm VM on b: host %s note %q, want b decided by the warm preference", dry.Host, dry.Note)
	}
	for _, r := range dry.Ranked {
		if want := map[string]int{"a": 0, "b": 1}[r.Host]; r.WarmReady != want {
			t.Errorf("dry run: %s warm_ready = %d, want %d", r.Host, r.WarmReady, want)
		}
	}
	vm, err := c.Client.CreateVM(ctx, warmVM("pref-1"), "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Host != "b" || vm.StartedFrom != api.StartedWarm {
		t.Fatalf("create: host %s started_from %s, want b and warm", vm.Host, vm.StartedFrom)
	}
	if vm.Placement == nil || !strings.Contains(vm.Placement.Note, "warm preference decided") {
		t.Errorf("create: placement %+v, want a note that the warm preference decided", vm.Placement)
	}

	// Load b far beyond the margin; its refilled warm VM no longer wins.
	if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "big", Image: "sim", VCPUs: 4, MemoryMiB: 12288, DiskMiB: 1024, Host: "b"}, ""); err != nil {
		t.Fatal(err)
	}
	eventually(t, "host b refills its warm VM", func() bool { return hostReady(t, c, "b") == 1 })
	dry, err = c.Client.Place(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Host != "a" || dry.Note != "" {
		t.Fatalf("dry run with b loaded: host %s note %q (ranked %+v), want a and no note", dry.Host, dry.Note, dry.Ranked)
	}
	vm, err = c.Client.CreateVM(ctx, warmVM("pref-2"), "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Host != "a" || vm.StartedFrom != api.StartedCold {
		t.Errorf("create with b loaded: host %s started_from %s, want a and cold", vm.Host, vm.StartedFrom)
	}
}

// TestWarmPoolCountsAsCapacityAndMakesRoom: a host's warm VMs show in its
// warm and free capacity; a create that needs their share succeeds, its
// agent evicting warm VMs until user VMs and warm VMs fit the host again.
func TestWarmPoolCountsAsCapacityAndMakesRoom(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		ag := testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: 8, MemoryMiB: 2048, DiskMiB: 102400})
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		if _, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: warmTarget(2)}); err != nil {
			t.Fatal(err)
		}
		host := func() api.Host {
			h, err := c.Client.GetHost(ctx, "h1")
			if err != nil {
				t.Fatal(err)
			}
			return h
		}
		eventually(t, "host h1 counts its 2 warm VMs", func() bool { return host().Warm.MemoryMiB == 1024 })
		if h := host(); h.Free.MemoryMiB != 1024 || h.Free.DiskMiB != 102400-2048 {
			t.Fatalf("free with 2 warm VMs of 512 MiB on 2048 MiB = %+v, want 1024 MiB memory and the warm disks out", h.Free)
		}

		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "big", Image: "sim", VCPUs: 2, MemoryMiB: 1536, DiskMiB: 1024}, "")
		if err != nil {
			t.Fatalf("a create that needs the warm VMs' share: %v", err)
		}
		if vm.ObservedState != "running" {
			t.Fatalf("vm big is %s, want running", vm.ObservedState)
		}
		info, err := ag.Client.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if used := info.Allocated.MemoryMiB + info.Warm.MemoryMiB; used > 2048 {
			t.Fatalf("agent runs %d MiB of vms and %d MiB of warm vms on 2048 MiB", info.Allocated.MemoryMiB, info.Warm.MemoryMiB)
		}
		eventually(t, "host h1 shows the evicted pool", func() bool {
			h := host()
			return h.Allocated.MemoryMiB == 1536 && h.Warm.MemoryMiB == 512 && h.Free.MemoryMiB == 0
		})
	})
}
