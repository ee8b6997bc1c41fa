package faulttest

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// startResizeGate holds the first resize call (PUT /v1/vms/{id}/shape)
// to the agent, before the agent sees it or after it applied it (forward).
func startResizeGate(t *testing.T, agentURL string, forward bool) *callGate {
	t.Helper()
	return startCallGate(t, agentURL, forward, func(r *http.Request) bool {
		return r.Method == http.MethodPut && strings.HasSuffix(r.URL.Path, "/shape")
	})
}

// kvmd control is killed with SIGKILL in the middle of a resize: after it
// reserved the growth and recorded the pending shape, either before the
// agent got the call or after the agent applied it but before the row was
// settled. After a restart, the row, the host's allocation and the VM the
// agent runs agree, in the old shape or the new one respectively.
func TestKill9DuringResize(t *testing.T) {
	bin := buildKVMD(t)
	for _, tc := range []struct {
		name    string
		forward bool
	}{{"before the agent call", false}, {"after the agent applied it", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Run("sqlite", func(t *testing.T) { kill9DuringResize(t, bin, "", t.TempDir(), tc.forward) })
			t.Run("postgres", func(t *testing.T) { kill9DuringResize(t, bin, testenv.PostgresURL(t), "", tc.forward) })
		})
	}
}

func kill9DuringResize(t *testing.T, bin, databaseURL, dataDir string, applied bool) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
	gate := startResizeGate(t, a.URL, applied)
	a.AllowAddress(t, gate.address)
	if _, err := k.client(true).PutHost(ctx, "h1", api.HostPut{Address: gate.address}); err != nil {
		t.Fatal(err)
	}
	agents := map[string]agentLister{"h1": realAgent(a)}
	var vm api.VM
	eventually(t, "the host is synced and takes a VM", func() error {
		var err error
		vm, err = k.client(false).CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024}, "")
		return err
	})
	if _, err := k.client(true).CreateVM(ctx, smallVM("other"), ""); err != nil {
		t.Fatal(err)
	}

	memory, vcpus := int64(4096), int64(1)
	answered := make(chan error, 1)
	go func() {
		_, err := k.client(false).UpdateVM(ctx, vm.ID, api.VMPatch{VCPUs: &vcpus, MemoryMiB: &memory})
		answered <- err
	}()
	select {
	case <-gate.reached:
	case err := <-answered:
		t.Fatalf("the resize answered (%v) before the gate held it", err)
	case <-ctx.Done():
		t.Fatal("the resize never reached the agent's gate")
	}
	k.kill()
	if err := <-answered; err == nil {
		t.Fatal("the resize answered success although kvmd was killed before it finished")
	}

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	wantV, wantM := int64(2), int64(2048)
	if applied {
		wantV, wantM = vcpus, memory
	}
	eventually(t, "the restarted control plane settles the resize", func() error {
		if err := ledger(ctx, c2, agents); err != nil {
			return err
		}
		row, err := c2.GetVM(ctx, vm.ID)
		if err != nil {
			return err
		}
		if row.PendingResize != nil {
			return fmt.Errorf("vm %s still has a pending resize to %+v", vm.ID, *row.PendingResize)
		}
		onAgent, err := a.Client.GetVM(ctx, vm.ID)
		if err != nil {
			return err
		}
		if row.VCPUs != onAgent.VCPUs || row.MemoryMiB != onAgent.MemoryMiB {
			return fmt.Errorf("row says %d vCPUs %d MiB, the agent runs %d vCPUs %d MiB", row.VCPUs, row.MemoryMiB, onAgent.VCPUs, onAgent.MemoryMiB)
		}
		if row.VCPUs != wantV || row.MemoryMiB != wantM || onAgent.State != "running" || row.ObservedState != api.StateRunning {
			return fmt.Errorf("vm %s settled to %d vCPUs %d MiB, %s on the agent (%s in the row); want %d vCPUs %d MiB running",
				vm.ID, row.VCPUs, row.MemoryMiB, onAgent.State, row.ObservedState, wantV, wantM)
		}
		return nil
	})
	// Resizes work again after the restart.
	if _, err := c2.UpdateVM(ctx, vm.ID, api.VMPatch{MemoryMiB: ptr[int64](3072)}); err != nil {
		t.Fatalf("resize after the restart: %v", err)
	}
	if err := ledger(ctx, c2, agents); err != nil {
		t.Error(err)
	}
}

func ptr[T any](v T) *T { return &v }
