package control_test

import (
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func waitConsoleCount(t *testing.T, a *testenv.Agent, id, pattern string, n int, within time.Duration) string {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(within)
	for {
		con, err := a.Client.Console(context.Background(), id)
		if err == nil && len(re.FindAllString(con, -1)) >= n {
			return con
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: %q not seen %d times on the console; it shows:\n%s", id, pattern, n, con)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// A registered busybox image boots through the control API on a real
// QEMU; disk_mib then grows in place on the running guest (QMP
// block_resize). The busybox init prints the disk size only at boot, so the
// test restarts the guest (stop, start) and reads the new size it prints.
func TestQEMUGrowDiskOfFetchedImage(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a real guest")
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir()})
	c.RegisterHost(t, "h1", a.Address)
	c.RegisterGuestImage(t, "busybox-fetched")
	ctx := context.Background()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "grow", Image: "busybox-fetched", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}, "")
	if err != nil {
		t.Fatal(err)
	}
	waitConsoleCount(t, a, vm.ID, fmt.Sprintf(`(?m)^disk vda %d\r?$`, int64(64)<<20), 1, 3*time.Minute)

	size := int64(128)
	vm, err = c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{DiskMiB: &size})
	if err != nil || vm.DiskMiB != 128 || vm.ObservedState != api.StateRunning {
		t.Fatalf("grow the running guest's disk: %+v %v", vm, err)
	}
	// Online: the running guest sees the new size at once (its init prints
	// the disk's size again when it changes), no restart.
	waitConsoleCount(t, a, vm.ID, fmt.Sprintf(`(?m)^disk vda %d\r?$`, int64(128)<<20), 1, time.Minute)
	if got, err := a.Client.GetVM(ctx, vm.ID); err != nil || got.PID == 0 || got.State != "running" {
		t.Fatalf("after the online growth: %+v %v", got, err)
	}

	// Offline: grown while stopped, seen at the next boot.
	stopped, running := api.PowerStopped, api.PowerRunning
	if _, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &stopped}); err != nil {
		t.Fatal(err)
	}
	size = 192
	if _, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{DiskMiB: &size}); err != nil {
		t.Fatalf("grow the stopped guest's disk: %v", err)
	}
	if _, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &running}); err != nil {
		t.Fatal(err)
	}
	waitConsoleCount(t, a, vm.ID, fmt.Sprintf(`(?m)^disk vda %d\r?$`, int64(192)<<20), 1, 3*time.Minute)
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}
