package control_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var (
	readyLine  = regexp.MustCompile(`(?m)^kvm-guest-ready\r?$`)
	memoryLine = regexp.MustCompile(`(?m)^kvm-guest-memory (\d+) kB\r?$`)
	cpusLine   = regexp.MustCompile(`(?m)^kvm-guest-cpus (\d+)\r?$`)
	markerLine = regexp.MustCompile(`(?m)^kvm-guest-disk-marker vda (\S+)\r?$`)
)

// guestShape waits for the n-th boot on the VM's console and returns the
// memory (kB), vCPUs and disk marker that boot reported.
func guestShape(t *testing.T, c *agentapi.Client, id string, n int) (int64, int64, string) {
	t.Helper()
	ctx := ctxT(t)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, err := c.Console(ctx, id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		boots := readyLine.FindAllStringIndex(con, -1)
		if len(boots) > n {
			t.Fatalf("vm %s booted %d times, want %d; console:\n%s", id, len(boots), n, con)
		}
		if len(boots) == n {
			this := con[boots[n-1][0]:]
			mem, cpus := memoryLine.FindStringSubmatch(this), cpusLine.FindStringSubmatch(this)
			if mem != nil && cpus != nil {
				kb, _ := strconv.ParseInt(mem[1], 10, 64)
				nc, _ := strconv.ParseInt(cpus[1], 10, 64)
				marker := ""
				if m := markerLine.FindStringSubmatch(this); m != nil {
					marker = m[1]
				}
				return kb, nc, marker
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: boot %d never reported its shape; console:\n%s", id, n, con)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// A fork child runs from the snapshot: its disk an overlay on the frozen
// source disk, its RAM mapped from the snapshot's RAM image. Resized, it
// boots again from its own disk (the marker written on the source's disk
// before the fork is there) with fresh RAM of the new size; the same on a
// host that pulled the snapshot; and a child stopped and started does the
// same. The fork and the ledger stay consistent.
func TestResizeForkChildrenRealGuests(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
	if testing.Short() {
		t.Skip("boots real guests")
	}
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	agents := map[string]*testenv.Agent{
		"h1": testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 4, MemoryMiB: 256, DiskMiB: 8192}),
		"h2": testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 4, MemoryMiB: 2048, DiskMiB: 8192}),
	}
	for name, a := range agents {
		c.RegisterHost(t, name, a.Address)
	}
	src, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "src", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		Host: "h1", PowerState: api.PowerStopped}, "")
	if err != nil {
		t.Fatal(err)
	}
	const marker = "kvm-marker:fork-child-disk"
	buf := make([]byte, 512)
	copy(buf, marker)
	markerFile := filepath.Join(t.TempDir(), "marker")
	if err := os.WriteFile(markerFile, buf, 0o600); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(agents["h1"].StateDir, "vms", src.ID, "disk.qcow2")
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -s "+markerFile+" 0 512", disk).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v: %s", err, out)
	}
	running := api.PowerRunning
	if _, err := c.Client.UpdateVM(ctx, src.ID, api.VMPatch{PowerState: &running}); err != nil {
		t.Fatal(err)
	}
	if _, _, m := guestShape(t, agents["h1"].Client, src.ID, 1); m != marker {
		t.Fatalf("source reads marker %q", m)
	}
	waitTicks(t, agents["h1"].Client, src.ID, 1)
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 3, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatal(err)
	}
	var hosts []string
	for _, ch := range f.Children {
		hosts = append(hosts, ch.Host)
	}
	if strings.Join(hosts, ",") != "h1,h2,h2" {
		t.Fatalf("children on %v, want one beside the source and two spilled to h2", hosts)
	}
	for i, ch := range f.Children {
		a := agents[ch.Host]
		waitTicks(t, a.Client, ch.ID, 1)
		var patch api.VMPatch
		wantCPUs, wantMin := int64(1), int64(128*1024)
		switch i {
		case 0: // more vCPUs, on the source's host
			v := int64(2)
			patch, wantCPUs, wantMin = api.VMPatch{VCPUs: &v}, 2, 0
		case 1: // more memory, on a host that pulled the snapshot
			mem := int64(256)
			patch, wantMin = api.VMPatch{MemoryMiB: &mem}, 128*1024
		case 2: // a stop and a start: the same cold boot from its own disk
			stopped := api.PowerStopped
			if _, err := c.Client.UpdateVM(ctx, ch.ID, api.VMPatch{PowerState: &stopped}); err != nil {
				t.Fatalf("stop child %s: %v", ch.Name, err)
			}
			patch, wantMin = api.VMPatch{PowerState: &running}, 0
		}
		got, err := c.Client.UpdateVM(ctx, ch.ID, patch)
		if err != nil {
			t.Fatalf("change child %s on %s: %v", ch.Name, ch.Host, err)
		}
		if got.ID != ch.ID || got.ObservedState != api.StateRunning || got.ForkID != f.ID || got.VCPUs != wantCPUs {
			t.Errorf("child %s after the change: %+v", ch.Name, got)
		}
		kb, cpus, m := guestShape(t, a.Client, ch.ID, 1)
		t.Logf("child %s on %s after the change: %d kB, %d vCPUs, marker %q", ch.Name, ch.Host, kb, cpus, m)
		if m != marker || cpus != wantCPUs || kb <= wantMin {
			t.Errorf("child %s boots with %d kB, %d vCPUs, marker %q; want more than %d kB, %d vCPUs and the source's marker",
				ch.Name, kb, cpus, m, wantMin, wantCPUs)
		}
		if con, _ := a.Client.Console(ctx, ch.ID); !strings.Contains(con, "disk vda 67108864") {
			t.Errorf("child %s lost its 64 MiB disk", ch.Name)
		}
	}
	checkLedger(t, c.Store)
	f, err = c.Client.GetFork(ctx, f.ID)
	if err != nil || f.Phase != api.ForkReady || len(f.Children) != 3 {
		t.Fatalf("fork after the changes: %+v %v", f, err)
	}
	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
	checkLedger(t, c.Store)
}
