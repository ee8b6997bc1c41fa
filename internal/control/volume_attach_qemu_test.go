package control_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// waitConsoleLine waits until line appears at least n times on the VM's
// serial console (through the control API), and fails after a generous
// deadline with the console.
func waitConsoleLine(t *testing.T, c *testenv.Control, id, line string, n int) {
	t.Helper()
	ctx := ctxT(t)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, err := c.Client.VMConsole(ctx, id, 1<<20)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if countLines(con, line) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: %q never appeared %d times; console:\n%s", id, line, n, con)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func countLines(console, line string) int {
	n := 0
	for _, l := range strings.Split(console, "\n") {
		if strings.TrimRight(l, "\r") == line {
			n++
		}
	}
	return n
}

// qemuHolds says whether QEMU process pid has the file at path open (one
// of its /proc/<pid>/fd links is that file).
func qemuHolds(t *testing.T, pid int, path string) bool {
	t.Helper()
	want, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatalf("descriptors of qemu %d: %v", pid, err)
	}
	for _, fd := range fds {
		if fi, err := os.Stat(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && os.SameFile(fi, want) {
			return true
		}
	}
	return false
}

// A real busybox guest under TCG, through the control API: a volume is
// hot-attached (five times, each timed from the call to the guest's
// "kvm-guest-disk <serial> <bytes>" line, without a reboot), and
// hot-detached: the guest says "kvm-guest-disk-gone <serial>" and QEMU no
// longer holds the volume's file. Rows and the agent agree throughout.
func TestVolumeHotAttachRealGuest(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
	if testing.Short() {
		t.Skip("boots a real guest")
	}
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 8192})
	c.RegisterHost(t, "h1", a.Address)
	f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a}}
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "guest", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}, "")
	if err != nil {
		t.Fatal(err)
	}
	waitConsoleLine(t, c, vm.ID, "kvm-guest-ready", 1)
	vol := f.createVolume(t, api.VolumeCreate{Name: "hot", SizeMiB: 32, Host: "h1"})
	matches, _ := filepath.Glob(filepath.Join(a.StateDir, "volumes", vol.ID, "disk*.qcow2"))
	if len(matches) != 1 {
		t.Fatalf("volume %s has disk files %v, want one", vol.ID, matches)
	}
	file := matches[0]
	onAgent, err := a.Client.GetVM(ctx, vm.ID)
	if err != nil || onAgent.PID == 0 {
		t.Fatalf("vm %s on its agent: %+v, %v; want a QEMU pid", vm.ID, onAgent, err)
	}
	if qemuHolds(t, onAgent.PID, file) {
		t.Fatalf("qemu %d holds %s before any attach", onAgent.PID, file)
	}
	seen := fmt.Sprintf("kvm-guest-disk %s %d", vol.Serial, 32<<20)
	gone := "kvm-guest-disk-gone " + vol.Serial

	var took []time.Duration
	for i := 1; i <= 5; i++ {
		start := time.Now()
		got := f.attach(t, vm.ID, vol.ID, false)
		if !vmHas(got, vol.ID, false) {
			t.Fatalf("attach %d answered volumes %+v", i, got.Volumes)
		}
		waitConsoleLine(t, c, vm.ID, seen, i)
		took = append(took, time.Since(start))
		if !qemuHolds(t, onAgent.PID, file) {
			t.Fatalf("attach %d: qemu %d does not hold %s", i, onAgent.PID, file)
		}
		f.attachState(t).agree(t)

		f.detach(t, vm.ID, vol.ID)
		waitConsoleLine(t, c, vm.ID, gone, i)
		if qemuHolds(t, onAgent.PID, file) {
			t.Fatalf("detach %d: qemu %d still holds %s", i, onAgent.PID, file)
		}
		f.attachState(t).agree(t)
	}
	// One boot: the guest saw every attach and detach while it ran.
	if after, err := a.Client.GetVM(ctx, vm.ID); err != nil || after.PID != onAgent.PID {
		t.Errorf("vm %s: QEMU pid %d after the attaches (%v), was %d: the guest must not restart", vm.ID, after.PID, err, onAgent.PID)
	}
	con, err := c.Client.VMConsole(ctx, vm.ID, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if n := countLines(con, "kvm-guest-ready"); n != 1 {
		t.Errorf("the guest booted %d times, want once", n)
	}
	slices.Sort(took)
	t.Logf("hot attach through the control API, call to disk visible in the guest (TCG): p50 %s of %v",
		took[len(took)/2].Round(time.Millisecond), took)
	checkLedger(t, c.Store)
}
