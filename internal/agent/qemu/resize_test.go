package qemu_test

import (
	"context"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
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
		// moved with it, but it may have been paused before it printed its
		// memory); each resize adds one boot, whose memory line counts.
		kb := h.bootMemoryKB(t, "hot", i+2)
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

// bootMemoryKB waits until boot n (1 is the first) of vm id has printed
// its memory line on the console and returns it in kB. Boots are told
// apart by the init's first line, so a line the earlier boot printed late
// is never taken for this one's.
func (h *qemuPool) bootMemoryKB(t *testing.T, id string, n int) int64 {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		con, err := h.client.Console(context.Background(), id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if boots := strings.Split(con, "kvm-guest-init uptime"); len(boots) > n {
			if m := guestMemoryLine.FindStringSubmatch(boots[n]); m != nil {
				kb, _ := strconv.ParseInt(m[1], 10, 64)
				return kb
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: boot %d printed no memory line within %s; console:\n%s", id, n, bootWait, con)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
