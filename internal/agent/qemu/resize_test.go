package qemu_test

import (
	"context"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var guestMemoryLine = regexp.MustCompile(`(?m)^kvm-guest-memory (\d+) kB\r?$`)

// A VM handed out by the warm pool (its QEMU started in the pool's
// directory, then moved to the VM's) resizes like any other: its old QEMU
// ends, a new one boots in the VM's own directory from the same disk, and
// the guest sees the new memory. A second resize of the restarted VM works
// too, and after an agent restart the VM is re-adopted in its new shape.
func TestResizeWarmVMRestartsFromItsOwnDisk(t *testing.T) {
	t.Parallel()
	dir := poolStateDir(t)
	h := startQEMUPool(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	h.setPool(t, 1)
	h.waitReady(t, 1)
	vm, err := h.client.CreateVM(ctx, "hot", guest)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("warm create = %+v, %v", vm, err)
	}
	h.setPool(t, 0)
	vdir := filepath.Join(dir, "vms", "hot")
	disk := inode(t, filepath.Join(vdir, "disk.qcow2"))
	warmPID := vm.PID

	for i, mem := range []int64{256, 192} {
		got, err := h.client.ResizeVM(ctx, "hot", agentapi.VMShape{VCPUs: 1, MemoryMiB: mem})
		if err != nil {
			t.Fatalf("resize to %d MiB: %v", mem, err)
		}
		if got.State != agentapi.StateRunning || got.MemoryMiB != mem || got.PID == 0 || got.PID == warmPID {
			t.Fatalf("resize to %d MiB answered %+v; want running in a new QEMU (the warm one was %d)", mem, got, warmPID)
		}
		if pidAlive(warmPID) {
			t.Errorf("the warm VM's QEMU %d still runs after the resize", warmPID)
		}
		if pid := onePID(t, vdir); pid != got.PID {
			t.Errorf("QEMU of vm hot is %d, the agent says %d", pid, got.PID)
		}
		if st := qmpRunState(t, filepath.Join(vdir, "qmp.sock")); st != "running" {
			t.Errorf("qemu says %q after the resize", st)
		}
		if got := inode(t, filepath.Join(vdir, "disk.qcow2")); got != disk {
			t.Errorf("vm hot's disk is inode %d after the resize, want its own %d", got, disk)
		}
		// The warm guest booted once before it was handed out (its console
		// moved with it); each resize adds one boot.
		con := h.waitConsoleLines(t, "hot", `(?m)^kvm-guest-memory \d+ kB\r?$`, i+2)
		all := guestMemoryLine.FindAllStringSubmatch(con, -1)
		kb, _ := strconv.ParseInt(all[i+1][1], 10, 64)
		if kb <= (mem-64)*1024 || kb > mem*1024 {
			t.Errorf("a %d MiB guest reports %d kB", mem, kb)
		}
		warmPID = got.PID
	}
	h.stop()
	h2 := startQEMUPool(t, dir)
	got, err := h2.client.GetVM(ctx, "hot")
	if err != nil || got.State != agentapi.StateRunning || got.MemoryMiB != 192 || got.PID != warmPID {
		t.Fatalf("after an agent restart: %+v, %v; want running with 192 MiB in QEMU %d", got, err, warmPID)
	}
}

// waitConsoleLines waits until pattern appears n times on vm id's console.
func (h *qemuPool) waitConsoleLines(t *testing.T, id, pattern string, n int) string {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(bootWait)
	for {
		con, err := h.client.Console(context.Background(), id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if len(re.FindAllString(con, -1)) >= n {
			return con
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: %q not %d times on the console within %s; console:\n%s", id, pattern, n, bootWait, con)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
