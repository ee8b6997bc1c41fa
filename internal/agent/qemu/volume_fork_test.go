package qemu_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	volForkChild   = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
	volForkSpilled = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
)

// markerScript is a busybox user_data script that finds the disk of the
// volume with serial by /sys/block/vd*/serial (busybox has no udev),
// writes "kvm-marker:<id>" at its start and syncs, then keeps writing a
// counter further in, once a second, and says each write on the console.
func markerScript(serial, id string) string {
	return `#!/bin/sh
dev=
for b in /sys/block/vd*; do
  [ "$(cat $b/serial 2>/dev/null)" = "` + serial + `" ] && dev=/dev/${b##*/}
done
[ -n "$dev" ] || { echo "kvm-test-no-volume" >/dev/console; exit 1; }
printf 'kvm-marker:` + id + `' | dd of=$dev bs=512 conv=sync 2>/dev/null
sync
echo "kvm-test-marker-written $dev" >/dev/console
i=0
while true; do
  i=$((i + 1))
  printf 'kvm-write:%08d' $i | dd of=$dev bs=512 seek=8 conv=sync 2>/dev/null
  sync
  echo "kvm-test-wrote $i" >/dev/console
  sleep 1
done
`
}

var wroteLine = regexp.MustCompile(`kvm-test-wrote ([0-9]+)`)

// lastWrite is the last counter a guest's script said it wrote.
func lastWrite(con string) int {
	m := wroteLine.FindAllStringSubmatch(con, -1)
	if len(m) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(m[len(m)-1][1])
	return n
}

// A real busybox guest under TCG writes a marker onto its volume; it is
// forked: the snapshot freezes the volume in the paused window while the
// guest goes on writing (to a new overlay). A child on the same agent gets
// a clone of the frozen point, a child on another agent a copy pulled
// from the first; each, started again, reads the marker from its own
// volume (its own serial), and the parent never stops writing.
func TestForkGuestWithVolume(t *testing.T) {
	a := startQEMUAgent(t)
	b := startQEMUAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	if _, err := a.Client.CreateVolume(ctx, volData, agentapi.VolumeSpec{SizeMiB: 32}); err != nil {
		t.Fatal(err)
	}
	serial := agentapi.VolumeSerial(volData)
	src := guest
	src.Volumes = []agentapi.VolumeAttachment{{ID: volData}}
	src.Seed = &agentapi.SeedSpec{InstanceID: "src", Hostname: "src", UserData: markerScript(serial, volData)}
	vm, err := a.Client.CreateVM(ctx, "src", src)
	if err != nil {
		t.Fatal(err)
	}
	waitConsole(t, a, "src", "kvm-test-marker-written /dev/vd", 1)
	waitConsole(t, a, "src", "kvm-test-wrote 2", 1)

	start := time.Now()
	snap, err := a.Client.CreateSnapshot(ctx, "fork-vol", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil {
		t.Fatalf("snapshot of a guest with a volume: %v", err)
	}
	t.Logf("snapshot of a %d MiB guest with a volume (memory, disk and volume frozen): call took %s",
		guest.MemoryMiB, time.Since(start).Round(time.Millisecond))
	if len(snap.Volumes) != 1 || !snap.Volumes[0].Frozen || snap.Volumes[0].ID != volData {
		t.Fatalf("snapshot volumes = %+v, want %s frozen", snap.Volumes, volData)
	}
	// The parent goes on writing, to its volume's new overlay, which its
	// QEMU holds; the frozen file is no longer the volume's own.
	con, err := a.Client.Console(ctx, "src")
	if err != nil {
		t.Fatal(err)
	}
	atFork := lastWrite(con)
	waitConsole(t, a, "src", fmt.Sprintf("kvm-test-wrote %d", atFork+2), 1)
	top := volumeFile(t, a.StateDir, volData)
	if !holdsFile(t, vm.PID, top) {
		t.Fatalf("the parent's qemu %d does not hold its volume's overlay %s", vm.PID, top)
	}

	// A child beside it: a clone of the frozen point.
	if _, err := a.Client.CreateVolume(ctx, volForkChild, agentapi.VolumeSpec{SizeMiB: 32,
		Source: &agentapi.VolumeSource{Snapshot: "fork-vol", Volume: volData}}); err != nil {
		t.Fatalf("child volume: %v", err)
	}
	child := guest
	child.Snapshot = &agentapi.SnapshotSource{ID: "fork-vol"}
	child.Volumes = []agentapi.VolumeAttachment{{ID: volForkChild}}
	if _, err := a.Client.CreateVM(ctx, "child", child); err != nil {
		t.Fatalf("child with a volume: %v", err)
	}
	// It continues the parent's script, now writing its own volume.
	waitConsole(t, a, "child", "kvm-test-wrote", 1)

	// A child on another agent: the frozen point pulled from the first.
	key := agentapi.EncodeKey(a.PublicKey)
	if _, err := b.Client.CreateVolume(ctx, volForkSpilled, agentapi.VolumeSpec{SizeMiB: 32,
		Source: &agentapi.VolumeSource{Snapshot: "fork-vol", Volume: volData,
			Peer: &agentapi.VolumePeer{Agent: a.Address, PublicKey: key}}}); err != nil {
		t.Fatalf("spilled child volume pulled from the snapshot's agent: %v", err)
	}
	spilled := guest
	spilled.Snapshot = &agentapi.SnapshotSource{ID: "fork-vol", Address: a.Address, PublicKey: key}
	spilled.Volumes = []agentapi.VolumeAttachment{{ID: volForkSpilled}}
	if _, err := b.Client.CreateVM(ctx, "spilled", spilled); err != nil {
		t.Fatalf("spilled child with a volume: %v", err)
	}
	waitConsole(t, b, "spilled", "kvm-test-wrote", 1)

	// Started again, each child boots from its own volume: the guest
	// prints its serial and the marker written before the fork.
	for _, c := range []struct {
		client *agentapi.Client
		id     string
		vol    string
		con    func(pattern string)
	}{
		{a.Client, "child", volForkChild, func(p string) { waitConsole(t, a, "child", p, 1) }},
		{b.Client, "spilled", volForkSpilled, func(p string) { waitConsole(t, b, "spilled", p, 1) }},
	} {
		if _, err := c.client.Action(ctx, c.id, agentapi.ActionStop); err != nil {
			t.Fatalf("stop %s: %v", c.id, err)
		}
		if _, err := c.client.Action(ctx, c.id, agentapi.ActionStart); err != nil {
			t.Fatalf("start %s: %v", c.id, err)
		}
		c.con("kvm-guest-disk " + agentapi.VolumeSerial(c.vol) + " 33554432")
		c.con(`kvm-guest-disk-marker vd[a-z] kvm-marker:` + volData)
	}
	// The parent never stopped writing.
	con, err = a.Client.Console(ctx, "src")
	if err != nil {
		t.Fatal(err)
	}
	if n := lastWrite(con); n <= atFork+2 {
		t.Fatalf("the parent's last write is %d, %d at the fork: want it to go on", n, atFork)
	}
}
