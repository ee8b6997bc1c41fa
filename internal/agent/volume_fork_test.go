package agent_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	volChild  = "3a4b5c6d-7e8f-4a0b-9c1d-2e3f4a5b6c7d"
	volChild2 = "5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b"
)

// volFiles lists the files of a volume's directory, or of .bases.
func volFiles(t *testing.T, dir, id string) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(dir, "volumes", id))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// TestForkSnapshotFreezesVolumes: a snapshot of a VM with a read-write and
// a read-only volume freezes the read-write one into a base (the VM goes
// on on an overlay), records both with their slots, and a child attaches a
// clone of the frozen point and shares the read-only volume; the frozen
// point lives as long as the snapshot, also across a restart and after
// its source volume is gone.
func TestForkSnapshotFreezesVolumes(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	for _, id := range []string{volA, volB} {
		if _, err := h.client.CreateVolume(ctx, id, agentapi.VolumeSpec{SizeMiB: 8}); err != nil {
			t.Fatal(err)
		}
	}
	marker := []byte("kvm-marker:frozen")
	if err := os.WriteFile(filepath.Join(dir, "volumes", volA, "disk.qcow2"), marker, 0o600); err != nil {
		t.Fatal(err)
	}
	src := spec
	src.Volumes = []agentapi.VolumeAttachment{{ID: volA}, {ID: volB, ReadOnly: true}}
	if _, err := h.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	snap, err := h.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil {
		t.Fatalf("snapshot of a vm with volumes: %v", err)
	}
	want := []agentapi.SnapshotVolume{{ID: volA, SizeMiB: 8, Slot: 0, Frozen: true}, {ID: volB, SizeMiB: 8, ReadOnly: true, Slot: 1}}
	if !slices.Equal(snap.Volumes, want) {
		t.Fatalf("snapshot volumes = %+v, want %+v", snap.Volumes, want)
	}
	// The source volume goes on on its overlay; the old file is a base.
	if got := volFiles(t, dir, volA); !slices.Equal(got, []string{"disk.1.qcow2", "volume.json"}) {
		t.Fatalf("source volume files after the snapshot = %v, want the overlay and the metadata", got)
	}
	if w := h.driver.Writing(volA); filepath.Base(w) != "disk.1.qcow2" {
		t.Fatalf("the vm writes volume %s to %q after the snapshot, want its overlay disk.1.qcow2", volA, w)
	}
	if h.driver.Writing(volB) != "" {
		t.Fatalf("the read-only volume was moved: %q", h.driver.Writing(volB))
	}
	bases := volFiles(t, dir, ".bases")
	if len(bases) != 1 {
		t.Fatalf("bases after the snapshot = %v, want one", bases)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "volumes", ".bases", bases[0])); err != nil || !bytes.Equal(b[:len(marker)], marker) {
		t.Fatalf("frozen base holds %q, %v; want the marker written before the snapshot", b[:min(len(b), 20)], err)
	}
	// A retry answers the same snapshot and freezes nothing again.
	if again, err := h.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"}); err != nil || again.SHA256 != snap.SHA256 {
		t.Fatalf("retried snapshot: %v", err)
	}
	if got := volFiles(t, dir, ".bases"); len(got) != 1 {
		t.Fatalf("bases after a retried snapshot = %v", got)
	}

	// The child's volume: a clone of the frozen point.
	cv, err := h.client.CreateVolume(ctx, volChild, agentapi.VolumeSpec{SizeMiB: 8,
		Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volA}})
	if err != nil {
		t.Fatalf("child volume from the snapshot: %v", err)
	}
	if cv.Source == nil || cv.Source.Snapshot != "fork-1" || cv.Source.Volume != volA {
		t.Fatalf("child volume = %+v", cv)
	}
	// Bad input, each a clear 400 and nothing made.
	for name, s := range map[string]agentapi.VolumeSpec{
		"smaller":        {SizeMiB: 4, Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volA}},
		"read-only":      {SizeMiB: 8, Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volB}},
		"not a volume":   {SizeMiB: 8, Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volChild2}},
		"without volume": {SizeMiB: 8, Source: &agentapi.VolumeSource{Snapshot: "fork-1"}},
	} {
		if st, e, _ := call(t, h, http.MethodPut, "/v1/volumes/"+volChild2, s); st != http.StatusBadRequest {
			t.Fatalf("%s: %d %+v, want 400", name, st, e)
		}
	}
	if st, _, _ := call(t, h, http.MethodPut, "/v1/volumes/"+volChild2, agentapi.VolumeSpec{SizeMiB: 8,
		Source: &agentapi.VolumeSource{Snapshot: "no-such-fork", Volume: volA}}); st != http.StatusNotFound {
		t.Fatalf("volume of an unknown snapshot: %d, want 404", st)
	}
	if got := volFiles(t, dir, volChild2); got != nil {
		t.Fatalf("refused creates left %v", got)
	}

	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "fork-1"}
	// Its volumes must match the snapshot's.
	for name, vols := range map[string][]agentapi.VolumeAttachment{
		"none":                 nil,
		"the source's own":     {{ID: volA}, {ID: volB, ReadOnly: true}},
		"read-only not shared": {{ID: volChild}, {ID: volChild2, ReadOnly: true}},
		"read-write as ro":     {{ID: volChild, ReadOnly: true}, {ID: volB, ReadOnly: true}},
	} {
		c := child
		c.Volumes = vols
		if st, e, _ := call(t, h, http.MethodPut, "/v1/vms/child-bad", c); st/100 != 4 {
			t.Fatalf("child with volumes %s: %d %+v, want a 4xx", name, st, e)
		}
	}
	child.Volumes = []agentapi.VolumeAttachment{{ID: volChild}, {ID: volB, ReadOnly: true}}
	vm, err := h.client.CreateVM(ctx, "child-1", child)
	if err != nil {
		t.Fatalf("child with its volumes: %v", err)
	}
	if vm.State != agentapi.StateRunning || len(vm.Volumes) != 2 {
		t.Fatalf("child = %+v", vm)
	}
	if p := h.driver.Plugged("child-1"); !slices.Equal(p, sorted(volChild, volB)) {
		t.Fatalf("child's plugged volumes = %v", p)
	}
	if v, _ := h.client.GetVolume(ctx, volChild); v.AttachedTo != "child-1" || v.ReadOnly {
		t.Fatalf("child volume = %+v, want attached read-write to child-1", v)
	}

	// The source volume goes (its vm first); the frozen point stays for
	// the snapshot and the clone, also across a restart.
	if err := h.client.DeleteVM(ctx, "src"); err != nil {
		t.Fatal(err)
	}
	if err := h.client.DeleteVolume(ctx, volA); err != nil {
		t.Fatal(err)
	}
	h.stop()
	h = startHarness(t, dir, 0)
	if got := volFiles(t, dir, ".bases"); !slices.Equal(got, bases) {
		t.Fatalf("bases after the source volume went and a restart = %v, want %v", got, bases)
	}
	if _, err := h.client.CreateVolume(ctx, volChild2, agentapi.VolumeSpec{SizeMiB: 16,
		Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volA}}); err != nil {
		t.Fatalf("a second child volume after the source volume went: %v", err)
	}
	if err := h.client.DeleteVolume(ctx, volChild2); err != nil {
		t.Fatal(err)
	}
	// Only once the snapshot and every clone are gone does the base go.
	if err := h.client.DeleteVM(ctx, "child-1"); err != nil {
		t.Fatal(err)
	}
	if err := h.client.DeleteSnapshot(ctx, "fork-1"); err != nil {
		t.Fatal(err)
	}
	if got := volFiles(t, dir, ".bases"); !slices.Equal(got, bases) {
		t.Fatalf("bases with the snapshot gone but a clone left = %v, want %v", got, bases)
	}
	if err := h.client.DeleteVolume(ctx, volChild); err != nil {
		t.Fatal(err)
	}
	if got := volFiles(t, dir, ".bases"); len(got) != 0 {
		t.Fatalf("bases with nothing naming them = %v, want none", got)
	}
}

func sorted(s ...string) []string {
	slices.Sort(s)
	return s
}

// TestForkSnapshotVolumeSwitchFailure: a driver that fails to move a
// volume fails the snapshot, and the volume is recorded back onto the
// file the VM writes, with no overlay and no base left; the next try
// works.
func TestForkSnapshotVolumeSwitchFailure(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 8}); err != nil {
		t.Fatal(err)
	}
	src := spec
	src.Volumes = []agentapi.VolumeAttachment{{ID: volA}}
	if _, err := h.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	h.driver.FailVolumeSwitch(func(string) error { return errors.New("injected: blockdev-snapshot refused") })
	if _, err := h.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"}); err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("snapshot with a failing volume move: %v, want the driver's error", err)
	}
	if got := volFiles(t, dir, volA); !slices.Equal(got, []string{"disk.qcow2", "volume.json"}) {
		t.Fatalf("volume files after a failed snapshot = %v, want its own disk back", got)
	}
	if got := volFiles(t, dir, ".bases"); len(got) != 0 {
		t.Fatalf("bases after a failed snapshot = %v, want none", got)
	}
	if _, err := h.client.GetSnapshot(ctx, "fork-1"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("failed snapshot: %v, want not found", err)
	}
	// Restarted, the agent reads the volume back the same.
	h.stop()
	h = startHarness(t, dir, 0)
	if got := volFiles(t, dir, volA); !slices.Equal(got, []string{"disk.qcow2", "volume.json"}) {
		t.Fatalf("volume files after a restart = %v", got)
	}
	if _, err := h.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("snapshot once the driver moves volumes again: %v", err)
	}
	if got := volFiles(t, dir, volA); !slices.Equal(got, []string{"disk.1.qcow2", "volume.json"}) {
		t.Fatalf("volume files after the snapshot = %v", got)
	}
}

// TestForkChildVolumePulledFromPeer: a child on another agent pulls its
// volume from the snapshot's agent: the frozen point, not what the source
// volume holds now, digest checked; the child starts with it in its slot.
func TestForkChildVolumePulledFromPeer(t *testing.T) {
	ctx := context.Background()
	a := startHarness(t, t.TempDir(), 0)
	b := startHarness(t, t.TempDir(), 0)
	if _, err := a.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 1}); err != nil {
		t.Fatal(err)
	}
	frozen := []byte("kvm-marker:at-the-fork")
	if err := os.WriteFile(filepath.Join(a.dir, "volumes", volA, "disk.qcow2"), frozen, 0o600); err != nil {
		t.Fatal(err)
	}
	src := spec
	src.Volumes = []agentapi.VolumeAttachment{{ID: volA}}
	if _, err := a.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	if _, err := a.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatal(err)
	}
	// The source goes on writing, to its overlay.
	if err := os.WriteFile(filepath.Join(a.dir, "volumes", volA, "disk.1.qcow2"), []byte("kvm-marker:after-the-fork"), 0o600); err != nil {
		t.Fatal(err)
	}
	key := agentapi.EncodeKey(a.agent.PublicKey())
	peer := &agentapi.VolumePeer{Agent: a.srv.URL, PublicKey: key}
	// The snapshot pulled onto b has no frozen point of its own there.
	v, err := b.client.CreateVolume(ctx, volChild, agentapi.VolumeSpec{SizeMiB: 1,
		Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volA, Peer: peer}})
	if err != nil {
		t.Fatalf("pull a child volume from the snapshot's agent: %v", err)
	}
	if v.Source == nil || v.Source.Snapshot != "fork-1" {
		t.Fatalf("pulled child volume = %+v", v)
	}
	got, err := os.ReadFile(filepath.Join(b.dir, "volumes", volChild, "disk.qcow2"))
	if err != nil || !bytes.HasPrefix(got, frozen) {
		t.Fatalf("pulled child volume holds %q, %v; want the frozen point %q", got[:min(len(got), 32)], err, frozen)
	}
	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "fork-1", Address: a.srv.URL, PublicKey: key}
	child.Volumes = []agentapi.VolumeAttachment{{ID: volChild}}
	vm, err := b.client.CreateVM(ctx, "child-1", child)
	if err != nil {
		t.Fatalf("spilled child with its pulled volume: %v", err)
	}
	if len(vm.Volumes) != 1 || vm.Volumes[0].ID != volChild {
		t.Fatalf("spilled child volumes = %+v", vm.Volumes)
	}
	// On b the snapshot has no frozen point: a clone there is refused
	// with what to do instead.
	if st, e, _ := call(t, b, http.MethodPut, "/v1/volumes/"+volChild2, agentapi.VolumeSpec{SizeMiB: 1,
		Source: &agentapi.VolumeSource{Snapshot: "fork-1", Volume: volA}}); st != http.StatusConflict || !strings.Contains(e.Message, "source.peer") {
		t.Fatalf("clone of a pulled snapshot's volume: %d %+v, want 409 pointing at source.peer", st, e)
	}
}

// TestForkSnapshotVolumeCrashMidway: the agent dies with a volume's move
// recorded but not made (the state directory copied at that instant, as
// kill -9 would leave it). The agent that starts on it loses nothing: the
// volume reads its overlay on the frozen file (which the VMM still
// writes, so the chain reads the same), the unfinished snapshot is gone,
// and a new snapshot and a child's clone work.
func TestForkSnapshotVolumeCrashMidway(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 8}); err != nil {
		t.Fatal(err)
	}
	marker := []byte("kvm-marker:before-the-crash")
	if err := os.WriteFile(filepath.Join(dir, "volumes", volA, "disk.qcow2"), marker, 0o600); err != nil {
		t.Fatal(err)
	}
	src := spec
	src.Volumes = []agentapi.VolumeAttachment{{ID: volA}}
	if _, err := h.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	crashed := filepath.Join(t.TempDir(), "state")
	h.driver.FailVolumeSwitch(func(string) error {
		if out, err := exec.Command("cp", "-a", dir, crashed).CombinedOutput(); err != nil {
			t.Errorf("copy the state directory: %v: %s", err, out)
		}
		return errors.New("injected: the agent died here")
	})
	_, _ = h.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"})
	h.stop()

	h = startHarness(t, crashed, 0)
	if _, err := h.client.GetSnapshot(ctx, "fork-1"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("unfinished snapshot after the crash: %v, want not found", err)
	}
	if got := volFiles(t, crashed, volA); !slices.Equal(got, []string{"disk.1.qcow2", "volume.json"}) {
		t.Fatalf("volume files after the crash = %v, want the recorded overlay only", got)
	}
	bases := volFiles(t, crashed, ".bases")
	if len(bases) != 1 {
		t.Fatalf("bases after the crash = %v, want the frozen file its record names", bases)
	}
	if b, err := os.ReadFile(filepath.Join(crashed, "volumes", ".bases", bases[0])); err != nil || !bytes.HasPrefix(b, marker) {
		t.Fatalf("the frozen file lost the data: %q, %v", b[:min(len(b), 32)], err)
	}
	if _, err := h.client.CreateSnapshot(ctx, "fork-2", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("snapshot after the crash: %v", err)
	}
	if _, err := h.client.CreateVolume(ctx, volChild, agentapi.VolumeSpec{SizeMiB: 8,
		Source: &agentapi.VolumeSource{Snapshot: "fork-2", Volume: volA}}); err != nil {
		t.Fatalf("child volume after the crash: %v", err)
	}
	if got := volFiles(t, crashed, ".bases"); len(got) != 2 {
		t.Fatalf("bases after the second snapshot = %v, want both frozen files (a chain)", got)
	}
}
