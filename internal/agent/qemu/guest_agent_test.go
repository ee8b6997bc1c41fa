package qemu_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// debianWait bounds a Debian guest's boot to its guest agent under TCG.
const debianWait = 8 * time.Minute

// debianGuest is the spec of a Debian 12 guest with the guest agent
// channel; it skips the test when the image (make image-debian) is not
// in the guest image folder.
func debianGuest(t *testing.T, seed *agentapi.SeedSpec) agentapi.VMSpec {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a real Debian guest")
	}
	if _, err := os.Stat(filepath.Join(testenv.GuestImageDir(t), "debian-12", "image.json")); err != nil {
		t.Skip("no debian-12 image in the guest image folder (KVM_IMAGE_DIR): build it with make image-debian")
	}
	return agentapi.VMSpec{Image: "debian-12", VCPUs: 2, MemoryMiB: 768, DiskMiB: 2048, Seed: seed, GuestAgent: true}
}

// waitFor polls cond every second until it holds or wait ends; a vm of
// ids that stops running ends the wait at once.
func waitFor(t *testing.T, a *netAgent, wait time.Duration, what string, cond func() (bool, string), ids ...string) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		for _, id := range ids {
			if vm, err := a.client.GetVM(context.Background(), id); err == nil && vm.State != agentapi.StateRunning {
				t.Fatalf("%s: vm %s is %s (%s); console tail:\n%s", what, id, vm.State, vm.Reason, tail(a.console(t, id), 30))
			}
		}
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last: %s", what, wait, last)
		}
		time.Sleep(time.Second)
	}
}

// One Debian guest (each boot is minutes under TCG) shows what the guest
// agent brings:
//   - its address on a bridge-mode NIC that the control plane does not know
//     (the user's own network-config gives it), reported through the guest
//     agent: the agent's VM answer has it on that NIC, matched by MAC, and
//     the guest status says the guest agent is ready;
//   - a snapshot of the guest while a writer appends to a file without a
//     pause freezes its file systems: the snapshot's disk, converted to raw,
//     is a clean ext4 (e2fsck -fn) and the writer's file in it is whole,
//     every line complete and numbered in turn; the source goes on writing
//     (thawed), and so does a child started from the snapshot, which the
//     agent thawed in turn (its guest agent answers commands that a frozen
//     one refuses);
//   - its stop goes through the guest agent (guest-shutdown), and the
//     console shows the guest's own shutdown.
func TestGuestAgentOnADebianGuest(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	const mac, childMAC, addr = "52:54:00:71:00:01", "52:54:00:71:00:02", "10.81.0.23"
	netcfg := fmt.Sprintf(`version: 1
config:
  - type: physical
    name: eth0
    mac_address: "%s"
    subnets:
      - type: static
        address: %s/24
`, mac, addr)
	spec := debianGuest(t, &agentapi.SeedSpec{InstanceID: "qga-w", Hostname: "qga-w", NetworkConfig: netcfg, UserData: writerUserData})
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "qgabr0"}}
	if err := netlink.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	hostAddr, _ := netlink.ParseAddr("10.81.0.1/24")
	if err := netlink.AddrAdd(br, hostAddr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	// A Debian guest takes longer than the default 10 s to power off
	// under TCG.
	a := startNetAgent(t, t.TempDir(), func(c *agent.Config) { c.StopTimeout = 3 * time.Minute })
	ctx := context.Background()
	spec.NICs = []agentapi.NIC{{Network: "ops", Mode: agentapi.NetworkBridge, Bridge: "qgabr0", MACAddress: mac}}
	created, err := a.client.CreateVM(ctx, "qga-w", spec)
	if err != nil {
		t.Fatal(err)
	}
	if !created.GuestAgent || created.NICs[0].IPv4Address != "" {
		t.Fatalf("created vm %+v: want guest_agent and no address from the control plane", created)
	}

	// The address on the bridge-mode NIC, from the guest agent.
	start := time.Now()
	waitFor(t, a, debianWait, "the guest agent reports "+addr+" on the bridge-mode nic", func() (bool, string) {
		vm, err := a.client.GetVM(ctx, "qga-w")
		if err != nil {
			return false, err.Error()
		}
		return slices.Contains(vm.NICs[0].IPv4Addresses, addr), fmt.Sprintf("nics %+v", vm.NICs)
	}, "qga-w")
	t.Logf("the guest agent reported %s %s after create", addr, time.Since(start).Round(time.Second))
	g, err := a.client.Guest(ctx, "qga-w")
	if err != nil {
		t.Fatal(err)
	}
	if g.GuestAgent != agentapi.GuestAgentReady || !slices.Contains(g.IPv4Addresses, addr) {
		t.Fatalf("guest status %+v; want guest_agent ready and %s among its addresses", g, addr)
	}

	// A frozen snapshot of the writing guest.
	waitFor(t, a, debianWait, "the writer runs", func() (bool, string) {
		n := lastWriterCount(a.console(t, "qga-w"))
		return n >= 1000, fmt.Sprintf("writer at %d", n)
	}, "qga-w")
	snap, err := a.client.CreateSnapshot(ctx, "qga-s", agentapi.SnapshotSpec{VMID: "qga-w"})
	if err != nil {
		t.Fatal(err)
	}
	atFork := lastWriterCount(a.console(t, "qga-w"))
	if !snap.GuestAgent || !snap.FSFrozen || a.driver.FrozenSnapshots() != 1 || a.driver.UnfrozenSnapshots() != 0 {
		t.Fatalf("snapshot %+v, frozen %d, unfrozen %d; want one frozen snapshot of a vm with the guest agent",
			snap, a.driver.FrozenSnapshots(), a.driver.UnfrozenSnapshots())
	}
	checkWriterDisk(t, a, snap, atFork)

	// The source writes on.
	waitFor(t, a, 2*time.Minute, "the source writes on after the snapshot", func() (bool, string) {
		n := lastWriterCount(a.console(t, "qga-w"))
		return n >= atFork+1000, fmt.Sprintf("writer at %d", n)
	}, "qga-w")
	// A child from the snapshot (on the same bridge, with a MAC of its
	// own) is thawed and writes on from the fork point.
	child := spec
	child.Seed = nil
	child.Snapshot = &agentapi.SnapshotSource{ID: "qga-s"}
	child.NICs = []agentapi.NIC{{Network: "ops", Mode: agentapi.NetworkBridge, Bridge: "qgabr0", MACAddress: childMAC}}
	if _, err := a.client.CreateVM(ctx, "qga-c", child); err != nil {
		t.Fatal(err)
	}
	waitFor(t, a, 2*time.Minute, "the child is thawed and writes on", func() (bool, string) {
		g, err := a.client.Guest(ctx, "qga-c")
		if err != nil {
			return false, err.Error()
		}
		n := lastWriterCount(a.console(t, "qga-c"))
		return g.GuestAgent == agentapi.GuestAgentReady && n >= 1000, fmt.Sprintf("guest agent %s, writer at %d", g.GuestAgent, n)
	}, "qga-c")
	if n := a.driver.ThawFailures(); n != 0 {
		t.Fatalf("%d thaws failed", n)
	}

	// The source's stop, through its guest agent.
	stopStart := time.Now()
	if _, err := a.client.Action(ctx, "qga-w", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	t.Logf("the stop through the guest agent took %s", time.Since(stopStart).Round(time.Second))
	if n := a.driver.GuestAgentShutdowns(); n != 1 {
		t.Fatalf("guest agent shutdowns = %d; want 1: the stop went around the guest agent", n)
	}
	con := a.console(t, "qga-w")
	if !strings.Contains(con, "reboot: Power down") {
		t.Fatalf("the console has no %q: the guest did not run its own shutdown; console tail:\n%s", "reboot: Power down", tail(con, 40))
	}
	if !regexp.MustCompile(`(Stopped|Stopping) .*|Reached target .*(Power-Off|System Power Off)`).MatchString(con) {
		t.Fatalf("the console shows no systemd shutdown line; tail:\n%s", tail(con, 40))
	}
	if vm, _ := a.client.GetVM(ctx, "qga-w"); vm.State != agentapi.StateStopped {
		t.Fatalf("after stop the vm is %s", vm.State)
	}
}

// checkWriterDisk checks the snapshot's disk on its own: a clean ext4
// holding the writer's file whole, with at least the lines the writer had
// printed before the snapshot (less one console period).
func checkWriterDisk(t *testing.T, a *netAgent, snap agentapi.Snapshot, atFork int) {
	t.Helper()
	// The disk at the fork point, on its own.
	var disk string
	for _, f := range snap.Files {
		if f.Kind == agentapi.SnapshotFileDisk {
			disk = filepath.Join(a.dir, "snapshots", "qga-s", f.Name)
		}
	}
	if disk == "" {
		t.Fatalf("snapshot %+v has no disk", snap)
	}
	raw := filepath.Join(t.TempDir(), "root.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", disk, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert %s: %v: %s", disk, err, out)
	}
	if out, err := exec.Command("e2fsck", "-fn", raw).CombinedOutput(); err != nil {
		t.Fatalf("e2fsck -fn of the snapshot's disk: %v; the file system is not clean:\n%s", err, out)
	} else {
		t.Logf("e2fsck -fn of the snapshot's disk:\n%s", out)
	}
	out, err := exec.Command("debugfs", "-R", "cat /var/lib/writer.log", raw).Output()
	if err != nil {
		t.Fatalf("debugfs cat /var/lib/writer.log: %v", err)
	}
	if len(out) == 0 || out[len(out)-1] != '\n' {
		t.Fatalf("the writer's file on the snapshot's disk is %d bytes and does not end with a whole line", len(out))
	}
	lines := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	for i, l := range lines {
		m := writerLine.FindStringSubmatch(l)
		if m == nil || m[1] != strconv.Itoa(i+1) {
			t.Fatalf("line %d of the writer's file on the snapshot's disk is %q; want line %d whole", i+1, l, i+1)
		}
	}
	if len(lines) < atFork-500 || len(lines) < 1000 {
		t.Fatalf("the snapshot's disk holds %d lines of the writer; it had printed %d before the fork", len(lines), atFork)
	}
	t.Logf("snapshot's disk: clean, %d whole lines of the writer (it printed %d on the console before the snapshot)", len(lines), atFork)
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// writerUserData starts a writer that appends numbered lines to a file as
// fast as the guest can, and prints its count on the serial console every
// 500 lines.
const writerUserData = `#cloud-config
write_files:
  - path: /usr/local/bin/writer
    permissions: "0755"
    content: |
      #!/bin/sh
      i=0
      while :; do
        i=$((i+1))
        echo "line $i 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef" >> /var/lib/writer.log
        if [ $((i % 500)) -eq 0 ]; then echo "kvm-writer $i" > /dev/ttyS0; fi
      done
runcmd:
  - [systemd-run, --unit=writer, /usr/local/bin/writer]
`

var (
	writerLine  = regexp.MustCompile(`^line ([0-9]+) 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef$`)
	writerCount = regexp.MustCompile(`kvm-writer ([0-9]+)`)
)

// lastWriterCount is the last count the writer printed on a console.
func lastWriterCount(con string) int {
	m := writerCount.FindAllStringSubmatch(con, -1)
	if len(m) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(m[len(m)-1][1])
	return n
}

// A guest with the channel but no guest agent in it (the busybox image)
// behaves as one without: no addresses from it, a snapshot that goes on
// unfrozen (counted), a stop by ACPI and quit.
func TestGuestAgentChannelWithoutAGuestAgentFallsBack(t *testing.T) {
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	spec := guest
	spec.GuestAgent = true
	vm, err := a.client.CreateVM(ctx, "qga-none", spec)
	if err != nil {
		t.Fatal(err)
	}
	if !vm.GuestAgent {
		t.Fatalf("created %+v; want guest_agent", vm)
	}
	if _, err := os.Stat(filepath.Join(a.dir, "vms", "qga-none", "qga.sock")); err != nil {
		t.Fatalf("the guest agent socket is not in the vm's folder: %v", err)
	}
	a.waitConsoleLine(t, "qga-none", "tick 1")
	g, err := a.client.Guest(ctx, "qga-none")
	if err != nil {
		t.Fatal(err)
	}
	if g.GuestAgent != agentapi.GuestAgentWaiting {
		t.Fatalf("guest status %+v; want guest_agent waiting", g)
	}
	snap, err := a.client.CreateSnapshot(ctx, "qga-none-s", agentapi.SnapshotSpec{VMID: "qga-none"})
	if err != nil {
		t.Fatal(err)
	}
	if snap.FSFrozen || !snap.GuestAgent || a.driver.UnfrozenSnapshots() != 1 || a.driver.FrozenSnapshots() != 0 {
		t.Fatalf("snapshot %+v, frozen %d, unfrozen %d; want one unfrozen snapshot", snap, a.driver.FrozenSnapshots(), a.driver.UnfrozenSnapshots())
	}
	if _, err := a.client.Action(ctx, "qga-none", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	if n := a.driver.GuestAgentShutdowns(); n != 0 {
		t.Fatalf("guest agent shutdowns = %d; want 0 (nothing answered)", n)
	}
	// Without the channel nothing of it is there.
	plain, err := a.client.CreateVM(ctx, "qga-plain", guest)
	if err != nil {
		t.Fatal(err)
	}
	if plain.GuestAgent {
		t.Fatalf("vm without guest_agent: %+v", plain)
	}
	if _, err := os.Stat(filepath.Join(a.dir, "vms", "qga-plain", "qga.sock")); !os.IsNotExist(err) {
		t.Fatalf("a vm without guest_agent has a guest agent socket: %v", err)
	}
	if g, err := a.client.Guest(ctx, "qga-plain"); err != nil || g.GuestAgent != agentapi.GuestAgentNone {
		t.Fatalf("guest status of a vm without guest_agent: %+v, %v; want guest_agent none", g, err)
	}
}
