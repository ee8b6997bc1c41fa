package control_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A busybox guest under TCG writes a marker into its read-write volume
// (through its virtio disk, on h1), then keeps reading the volume's first
// bytes with its page cache dropped each time. It is migrated live to h2
// through the control API: afterwards the VM and the volume row are on
// h2, h1 has neither, the reads the guest makes on h2 (from h2's copy of
// the volume) return the marker, and h2's volume file holds it.
func TestQEMUMigrateVolumeMarker(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
	if testing.Short() {
		t.Skip("boots a real guest")
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	agents := map[string]*testenv.Agent{}
	for _, name := range []string{"h1", "h2"} {
		agents[name] = testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 8192})
		c.RegisterHost(t, name, agents[name].Address)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	vol, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 32, Host: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	marker := "kvm-marker:migrated-" + vol.Serial
	script := `#!/bin/sh
dev=""
for d in /sys/block/vd*; do [ "$(cat $d/serial 2>/dev/null)" = "` + vol.Serial + `" ] && dev=/dev/${d##*/}; done
printf '` + marker + `' | dd of=$dev bs=512 count=1 conv=sync,fsync 2>/dev/null
sync
echo "kvm-vol-wrote $dev"
while :; do
	echo 3 >/proc/sys/vm/drop_caches
	echo "kvm-vol-read $(head -c 64 $dev | tr -dc 'A-Za-z0-9:._-')"
	usleep 200000
done
`
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "voldb", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, Host: "h1",
		UserData: script, Volumes: []api.VMVolume{{Volume: vol.ID}}}, "")
	if err != nil {
		t.Fatal(err)
	}
	readLine := "kvm-vol-read " + marker
	waitConsoleCount(t, agents["h1"], vm.ID, regexp.QuoteMeta(readLine), 3, 4*time.Minute)

	start := time.Now()
	moved, err := c.Client.MigrateVM(ctx, vm.ID, "h2")
	if err != nil {
		t.Fatalf("migrate a vm with a volume: %v", err)
	}
	t.Logf("live migration of a 128 MiB busybox guest with a 32 MiB volume, through the control API: %v", time.Since(start).Round(time.Millisecond))
	if moved.Host != "h2" || moved.ObservedState != api.StateRunning {
		t.Fatalf("migrated vm on %s (%s); want running on h2", moved.Host, moved.ObservedState)
	}
	got, err := c.Client.GetVolume(ctx, vol.ID)
	if err != nil || got.Host != "h2" || got.State != api.VolumeReady {
		t.Fatalf("volume after the migration: %+v, %v; want ready on h2", got, err)
	}
	if _, err := agents["h1"].Client.GetVolume(ctx, vol.ID); err == nil {
		t.Error("h1 still has its copy of the volume after the migration")
	}
	if _, err := agents["h1"].Client.GetVM(ctx, vm.ID); err == nil {
		t.Error("h1 still has the vm after the migration")
	}
	checkLedger(t, c.Store)

	// The guest goes on on h2 (no reboot) and reads the marker from h2's
	// copy: its target console starts with the migration.
	con := waitConsoleCount(t, agents["h2"], vm.ID, regexp.QuoteMeta(readLine), 3, 2*time.Minute)
	if strings.Contains(con, "kvm-guest-ready") || strings.Contains(con, "kvm-vol-wrote") {
		t.Fatalf("the guest booted again on h2; console:\n%s", con)
	}
	if strings.Contains(con, "kvm-vol-read \n") || strings.Contains(con, "kvm-vol-read \r") {
		t.Fatalf("the guest read an empty volume on h2; console:\n%s", con)
	}

	// h2's file holds the marker (read beside the running QEMU).
	raw := filepath.Join(t.TempDir(), "vol.raw")
	file := filepath.Join(agents["h2"].StateDir, "volumes", vol.ID, "disk.qcow2")
	if out, err := exec.Command("qemu-img", "convert", "-U", "-f", "qcow2", "-O", "raw", file, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert %s: %v: %s", file, err, out)
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte(marker)) {
		t.Fatalf("h2's volume file starts with %q; want the marker %q", b[:min(len(b), 64)], marker)
	}
}
