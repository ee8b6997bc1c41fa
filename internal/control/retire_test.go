package control_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func clientCode(err error) string {
	var e *client.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

// TestRetireHost: POST /v1/hosts/{name}/retire is refused while the host's
// agent answers; once the agent is gone, one call marks its VMs lost with a
// reason, releases their capacity, group slots and addresses (the host's
// allocation is zero, the sum of its rows), and the host takes no VM and
// no re-registration again. A second retire changes nothing; DELETE of the
// host removes it with its lost VMs. The other host is untouched.
func TestRetireHost(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		gone := testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: 8, MemoryMiB: 8192, DiskMiB: 102400})
		stays := testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim", VCPUs: 8, MemoryMiB: 8192, DiskMiB: 102400})
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DeadAfter: 1})
		c.RegisterHost(t, "h1", gone.Address)
		c.RegisterHost(t, "h2", stays.Address)
		var onH1 []api.VM
		for _, name := range []string{"a", "b"} {
			vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024, Host: "h1",
				Constraints: &api.Constraints{Group: "g", SpreadBy: "host", MaxPerDomain: 2}}, "")
			if err != nil {
				t.Fatal(err)
			}
			onH1 = append(onH1, vm)
		}
		other, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "c", Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024, Host: "h2"}, "")
		if err != nil {
			t.Fatal(err)
		}

		if _, err := c.Client.RetireHost(ctx, "h1"); clientCode(err) != api.CodeConflict || !strings.Contains(err.Error(), "still answers") {
			t.Fatalf("retire of a host whose agent answers: %v; want 409 conflict saying so", err)
		}
		gone.Stop()
		eventually(t, "host h1 marked not alive", func() bool {
			h, err := c.Client.GetHost(ctx, "h1")
			return err == nil && !h.Alive
		})

		h, err := c.Client.RetireHost(ctx, "h1")
		if err != nil {
			t.Fatalf("retire h1: %v", err)
		}
		if h.RetiredAt == nil || h.Alive || h.Allocated != (api.Resources{}) {
			t.Fatalf("retired host = %+v; want retired_at set, not alive, nothing allocated", h)
		}
		for _, vm := range onH1 {
			got, err := c.Client.GetVM(ctx, vm.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.ObservedState != api.StateLost || !strings.Contains(got.Reason, "retired") {
				t.Errorf("vm %s on the retired host: observed_state %q reason %q; want lost with the reason", vm.Name, got.ObservedState, got.Reason)
			}
			row, err := c.Store.GetVM(ctx, vm.ID)
			if err != nil {
				t.Fatal(err)
			}
			if row.HoldsCapacity {
				t.Errorf("lost vm %s still holds capacity", vm.Name)
			}
		}
		assertAllocationEqualsRows(t, c, "h1")
		assertAllocationEqualsRows(t, c, "h2")
		if got, err := c.Client.GetVM(ctx, other.ID); err != nil || got.ObservedState != api.StateRunning {
			t.Errorf("vm c on h2 = %+v, %v; want it running, untouched", got, err)
		}
		// The group's slots on h1 came back.
		if counts, err := c.Store.GroupCounts(ctx, "g", "host"); err != nil || counts["h1"] != 0 {
			t.Errorf("group g per host after the retire = %v, %v; want none on h1", counts, err)
		}
		if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "pinned", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: "h1"}, ""); clientCode(err) != api.CodeNoCapacity {
			t.Fatalf("create pinned to the retired host: %v; want no_capacity", err)
		}

		again, err := c.Client.RetireHost(ctx, "h1")
		if err != nil || again.RetiredAt == nil || !again.RetiredAt.Equal(*h.RetiredAt) {
			t.Fatalf("second retire = %+v, %v; want the same retired host", again, err)
		}
		gone.Restart(t)
		if _, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: gone.Address}); clientCode(err) != api.CodeConflict {
			t.Fatalf("PUT of a retired host: %v; want 409", err)
		}
		c.Service.SyncNow(ctx)
		if h, _ := c.Client.GetHost(ctx, "h1"); h.Alive {
			t.Fatal("a retired host came back alive after its agent answered again")
		}

		if err := c.Client.DeleteHost(ctx, "h1"); err != nil {
			t.Fatalf("delete the retired host: %v", err)
		}
		for _, vm := range onH1 {
			if _, err := c.Client.GetVM(ctx, vm.ID); !errors.Is(err, client.ErrNotFound) {
				t.Errorf("lost vm %s after its host was deleted: %v; want not found", vm.Name, err)
			}
		}
	})
}

// assertAllocationEqualsRows: a host's allocation is the sum of its VM
// rows that hold capacity.
func assertAllocationEqualsRows(t *testing.T, c *testenv.Control, host string) {
	t.Helper()
	ctx := ctxT(t)
	h, err := c.Store.GetHost(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := c.Store.ListVMs(ctx, store.VMFilter{Host: host})
	if err != nil {
		t.Fatal(err)
	}
	var sum store.Resources
	for _, r := range rows {
		if r.HoldsCapacity {
			sum.VCPUs += r.Resources.VCPUs
			sum.MemoryMiB += r.Resources.MemoryMiB
			sum.DiskMiB += r.Resources.DiskMiB
		}
	}
	if h.Allocated != sum {
		t.Errorf("host %s allocated %+v, its rows hold %+v", host, h.Allocated, sum)
	}
}
