package control_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func TestVMLifecycle(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
		host := c.RegisterHost(t, "h1", agent.Address)
		if !host.Alive || host.Driver != "sim" || host.Capacity.VCPUs != 8 || !contains(host.Images, "sim") {
			t.Fatalf("registered host: %+v", host)
		}
		in := smallVM("web-1")
		in.Labels = map[string]string{"team": "red"}
		vm, err := c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		if vm.Host != "h1" || vm.ObservedState != api.StateRunning || vm.PowerState != api.PowerRunning || vm.Placement == nil || vm.Placement.Host != "h1" {
			t.Fatalf("created vm: %+v", vm)
		}
		if _, err := agent.Client.GetVM(ctx, vm.ID); err != nil {
			t.Fatalf("the agent must have the VM: %v", err)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) {
			t.Errorf("allocated after create: %+v", got)
		}
		// PUT is idempotent and keeps the allocation.
		again := c.RegisterHost(t, "h1", agent.Address)
		if again.Allocated != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) || again.Capacity != host.Capacity {
			t.Errorf("host after a second PUT: %+v", again)
		}

		got, err := c.Client.GetVM(ctx, vm.ID)
		if err != nil || got.ID != vm.ID || got.Labels["team"] != "red" {
			t.Fatalf("get: %+v %v", got, err)
		}
		for _, opts := range []client.ListOptions{{Host: "h1"}, {Name: "web-1"}, {Label: "team=red"}} {
			list, err := c.Client.ListVMs(ctx, opts)
			if err != nil || len(list.Items) != 1 || list.Items[0].ID != vm.ID {
				t.Errorf("list %+v: %+v %v", opts, list, err)
			}
		}
		if list, _ := c.Client.ListVMs(ctx, client.ListOptions{Label: "team=blue"}); len(list.Items) != 0 {
			t.Errorf("label filter must exclude: %+v", list.Items)
		}

		stopped := api.PowerStopped
		vm, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &stopped})
		if err != nil || vm.PowerState != api.PowerStopped || vm.ObservedState != api.StateStopped {
			t.Fatalf("stop: %+v %v", vm, err)
		}
		if a, _ := agent.Client.GetVM(ctx, vm.ID); a.State != "stopped" {
			t.Errorf("agent state after stop: %q", a.State)
		}
		labels := map[string]string{"team": "blue"}
		if vm, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{Labels: &labels}); err != nil || vm.Labels["team"] != "blue" {
			t.Fatalf("relabel: %+v %v", vm, err)
		}

		if err := c.Client.DeleteHost(ctx, "h1"); !errors.Is(err, client.ErrConflict) || !strings.Contains(err.Error(), "1 VMs") {
			t.Errorf("delete host with a VM: %v", err)
		}
		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatalf("delete vm: %v", err)
		}
		if _, err := agent.Client.GetVM(ctx, vm.ID); err == nil {
			t.Error("the agent still has the deleted VM")
		}
		if _, err := c.Client.GetVM(ctx, vm.ID); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("get after delete: %v", err)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{}) {
			t.Errorf("allocated after delete: %+v", got)
		}
		if err := c.Client.DeleteHost(ctx, "h1"); err != nil {
			t.Errorf("delete empty host: %v", err)
		}
		checkLedger(t, c.Store)
	})
}

func TestVMNamesAreUnique(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
		first, err := c.Client.CreateVM(ctx, smallVM("db"), "")
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Client.CreateVM(ctx, smallVM("db"), "")
		var e *client.Error
		if !errors.As(err, &e) || e.Status != 409 || !strings.Contains(e.Message, first.ID) || e.Details["existing_id"] != first.ID {
			t.Fatalf("second create with the same name: %v (details %v)", err, e)
		}
		if list, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(list) != 1 {
			t.Errorf("%d VMs, want 1", len(list))
		}
		checkLedger(t, c.Store)
	})
}

func TestPlacementSpreadsAndExplains(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "a", testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 4, MemoryMiB: 8192, DiskMiB: 100000}).Address)
	c.RegisterHost(t, "b", testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 4, MemoryMiB: 8192, DiskMiB: 100000}).Address)
	c.RegisterHost(t, "small", testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 4, MemoryMiB: 2048, DiskMiB: 100000}).Address)

	req := api.PlacementRequest{Image: "sim", VCPUs: 2, MemoryMiB: 4096, DiskMiB: 1000}
	dry, err := c.Client.Place(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Host != "a" || len(dry.Ranked) != 2 || dry.Ranked[1].Host != "b" {
		t.Errorf("dry run ranking (ties go to the first name): %+v", dry)
	}
	if len(dry.Rejected) != 1 || dry.Rejected[0] != (api.Rejection{Host: "small", Reason: api.ReasonMemory, Detail: "memory: needs 4096 MiB, 2048 free"}) {
		t.Errorf("dry run rejections: %+v", dry.Rejected)
	}
	if got := hostAllocated(t, c, "a"); got != (api.Resources{}) {
		t.Errorf("a dry run reserved %+v", got)
	}

	var hosts []string
	for _, name := range []string{"v1", "v2", "v3", "v4"} {
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 2, MemoryMiB: 4096, DiskMiB: 1000}, "")
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		hosts = append(hosts, vm.Host)
	}
	if strings.Join(hosts, ",") != "a,b,a,b" {
		t.Errorf("placements = %v, want spread a,b,a,b", hosts)
	}
	_, err = c.Client.CreateVM(ctx, api.VMCreate{Name: "v5", Image: "sim", VCPUs: 2, MemoryMiB: 4096, DiskMiB: 1000}, "")
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity {
		t.Fatalf("fifth create: %v", err)
	}
	reasons := e.Details["rejected"].([]any)
	if len(reasons) != 3 || !strings.Contains(e.Message, "3 hosts rejected") {
		t.Errorf("no_capacity must explain every host: %s %v", e.Message, reasons)
	}
	first := reasons[0].(map[string]any)
	if first["host"] != "a" || first["reason"] != api.ReasonMemory || first["detail"] != "memory: needs 4096 MiB, 0 free; vcpus: needs 2, 0 free" {
		t.Errorf("reason for a: %v", first)
	}

	// Pinning goes to the named host or explains why not.
	_, err = c.Client.CreateVM(ctx, api.VMCreate{Name: "pinned", Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10, Host: "small"}, "")
	if err != nil {
		t.Fatalf("pinned create: %v", err)
	}
	_, err = c.Client.CreateVM(ctx, api.VMCreate{Name: "pinned2", Image: "sim", VCPUs: 1, MemoryMiB: 2048, DiskMiB: 10, Host: "small"}, "")
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity || !strings.Contains(e.Message, "memory: needs 2048 MiB, 1024 free") {
		t.Errorf("pinned over capacity: %v", err)
	}
	checkLedger(t, c.Store)
}

func TestListsPage(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		// One agent per host: an agent's identity is pinned to one host.
		for _, name := range []string{"h3", "h1", "h2"} {
			c.RegisterHost(t, name, testenv.StartAgent(t, testenv.AgentOptions{}).Address)
		}
		page, err := c.Client.ListHosts(ctx, client.ListOptions{PageSize: 2})
		if err != nil || len(page.Items) != 2 || page.Items[0].Name != "h1" || page.NextPageToken == "" {
			t.Fatalf("first page of hosts: %+v %v", page, err)
		}
		page, err = c.Client.ListHosts(ctx, client.ListOptions{PageSize: 2, PageToken: page.NextPageToken})
		if err != nil || len(page.Items) != 1 || page.Items[0].Name != "h3" || page.NextPageToken != "" {
			t.Fatalf("second page of hosts: %+v %v", page, err)
		}
		var created []string
		for i := range 5 {
			vm, err := c.Client.CreateVM(ctx, smallVM(fmt.Sprintf("p%d", i)), "")
			if err != nil {
				t.Fatal(err)
			}
			created = append(created, vm.ID)
		}
		var listed []string
		token := ""
		for {
			p, err := c.Client.ListVMs(ctx, client.ListOptions{PageSize: 2, PageToken: token})
			if err != nil {
				t.Fatal(err)
			}
			for _, vm := range p.Items {
				listed = append(listed, vm.ID)
			}
			if token = p.NextPageToken; token == "" {
				break
			}
		}
		if strings.Join(listed, ",") != strings.Join(created, ",") {
			t.Errorf("paged VMs %v, want %v in creation order", listed, created)
		}
	})
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}
