package qemu_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const (
	volData  = "5b2f8c1e-3d4a-4e6b-9f70-8a9b0c1d2e3f"
	volExtra = "c41d7e92-0a3b-4c5d-8e6f-7a8b9c0d1e2f"
)

// volumeFile is the file a volume writes now (its metadata names it).
func volumeFile(t *testing.T, stateDir, id string) string {
	t.Helper()
	matches, _ := filepath.Glob(filepath.Join(stateDir, "volumes", id, "disk*.qcow2"))
	if len(matches) != 1 {
		t.Fatalf("volume %s has disk files %v, want one", id, matches)
	}
	return matches[0]
}

// holdsFile says whether process pid has path open.
func holdsFile(t *testing.T, pid int, path string) bool {
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

// A real busybox guest under TCG: a volume attached at boot is seen by its
// serial; a second one is hot-attached (five times, timed from the call to
// the guest's line), seen without a reboot, grown online, and hot-detached:
// the guest says it is gone and QEMU no longer holds its file.
func TestVolumeHotAttachDetachAndGrow(t *testing.T) {
	a := startQEMUAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for id, size := range map[string]int64{volData: 64, volExtra: 32} {
		if _, err := a.Client.CreateVolume(ctx, id, agentapi.VolumeSpec{SizeMiB: size}); err != nil {
			t.Fatalf("create volume %s: %v", id, err)
		}
	}
	spec := guest
	spec.Volumes = []agentapi.VolumeAttachment{{ID: volData}}
	vm, err := a.Client.CreateVM(ctx, "vol", spec)
	if err != nil {
		t.Fatalf("create vm with a volume: %v", err)
	}
	dataSerial, extraSerial := agentapi.VolumeSerial(volData), agentapi.VolumeSerial(volExtra)
	waitConsole(t, a, "vol", "kvm-guest-disk "+dataSerial+" 67108864", 1)
	extraFile := volumeFile(t, a.StateDir, volExtra)

	var took []time.Duration
	for i := 1; i <= 5; i++ {
		start := time.Now()
		if _, err := a.Client.AttachVolume(ctx, "vol", volExtra, false); err != nil {
			t.Fatalf("hot attach %d: %v", i, err)
		}
		waitConsole(t, a, "vol", "kvm-guest-disk "+extraSerial+" 33554432", i)
		took = append(took, time.Since(start))
		if !holdsFile(t, vm.PID, extraFile) {
			t.Fatalf("attach %d: qemu %d does not hold %s", i, vm.PID, extraFile)
		}
		if i == 5 {
			break // the last stays attached for the grow below
		}
		if err := a.Client.DetachVolume(ctx, "vol", volExtra); err != nil {
			t.Fatalf("hot detach %d: %v", i, err)
		}
		waitConsole(t, a, "vol", "kvm-guest-disk-gone "+extraSerial, i)
		if holdsFile(t, vm.PID, extraFile) {
			t.Fatalf("detach %d: qemu %d still holds %s", i, vm.PID, extraFile)
		}
	}
	slices.Sort(took)
	t.Logf("hot attach, call to disk visible in the guest: p50 %s of %v", took[len(took)/2].Round(time.Millisecond), took)

	// Online grow of the attached volume: the guest sees the new size.
	if v, err := a.Client.ResizeVolume(ctx, volExtra, 48); err != nil || v.SizeMiB != 48 {
		t.Fatalf("online grow: %+v, %v", v, err)
	}
	waitConsole(t, a, "vol", "kvm-guest-disk "+extraSerial+" 50331648", 1)

	// An attached volume cannot be deleted; the VM's delete detaches it.
	var ae *agentapi.Error
	if err := a.Client.DeleteVolume(ctx, volExtra); !errors.As(err, &ae) || ae.Code != "volume_attached" || !strings.Contains(ae.Message, "vol") {
		t.Fatalf("delete attached volume: %v, want 409 volume_attached naming vm vol", err)
	}
	if err := a.Client.DetachVolume(ctx, "vol", volExtra); err != nil {
		t.Fatalf("final detach: %v", err)
	}
	waitConsole(t, a, "vol", "kvm-guest-disk-gone "+extraSerial, 5)
	if holdsFile(t, vm.PID, extraFile) {
		t.Fatalf("qemu %d still holds %s after the last detach", vm.PID, extraFile)
	}
	if err := a.Client.DeleteVM(ctx, "vol"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{volData, volExtra} {
		if err := a.Client.DeleteVolume(ctx, id); err != nil {
			t.Fatalf("delete volume %s after its vm: %v", id, err)
		}
	}
}

// A volume attached read-only at boot is opened read-only by QEMU, and an
// attachment survives an agent restart and a stop and start of the VM.
func TestVolumeReadOnlyAtBootSurvivesRestart(t *testing.T) {
	a := startQEMUAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := a.Client.CreateVolume(ctx, volData, agentapi.VolumeSpec{SizeMiB: 16}); err != nil {
		t.Fatal(err)
	}
	spec := guest
	spec.Volumes = []agentapi.VolumeAttachment{{ID: volData, ReadOnly: true}}
	vm, err := a.Client.CreateVM(ctx, "ro", spec)
	if err != nil {
		t.Fatal(err)
	}
	serial := agentapi.VolumeSerial(volData)
	waitConsole(t, a, "ro", "kvm-guest-disk "+serial+" 16777216", 1)
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", vm.PID))
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`node-name=vol-` + serial + `,[^\x00]*read-only=on`)
	if !re.Match(cmdline) {
		t.Fatalf("qemu command line has no read-only volume node: %q", strings.ReplaceAll(string(cmdline), "\x00", " "))
	}
	// QEMU opened the volume as root before it dropped to its vm's uid:
	// that uid (like any other vm's) can neither read nor write the file.
	if os.Geteuid() == 0 {
		id := readProcIdentity(t, vm.PID)
		file := volumeFile(t, a.StateDir, volData)
		for _, op := range []string{"-r", "-w"} {
			if canAs(t, id, op, file) {
				t.Errorf("vm ro's qemu uid %d passes test %s on its volume %s; want volumes reachable by no vm's uid", id.uids[0], op, file)
			}
		}
	}
	a.Restart(t)
	if _, err := a.Client.Action(ctx, "ro", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Client.Action(ctx, "ro", agentapi.ActionStart); err != nil {
		t.Fatal(err)
	}
	got, err := a.Client.GetVM(ctx, "ro")
	if err != nil || len(got.Volumes) != 1 || !got.Volumes[0].ReadOnly {
		t.Fatalf("vm after an agent restart and a restart: %+v, %v", got.Volumes, err)
	}
	waitConsole(t, a, "ro", "kvm-guest-disk "+serial+" 16777216", 2)
}

// qemuIO runs qemu-io on a volume's file and returns its output.
func qemuIO(t *testing.T, path, cmd string) string {
	t.Helper()
	out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", cmd, path).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-io %s %q: %v: %s", path, cmd, err, out)
	}
	return string(out)
}

// A clone and its source never see each other's writes, and the clone
// stays whole after its source is deleted. An image's disk content makes a
// volume of the image's content, grown.
func TestVolumeCloneIsCopyOnWrite(t *testing.T) {
	testenv.RequireQEMU(t)
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	ctx := context.Background()
	if _, err := a.Client.CreateVolume(ctx, volData, agentapi.VolumeSpec{SizeMiB: 16}); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, volumeFile(t, a.StateDir, volData), "write -P 0x11 0 64k")
	if _, err := a.Client.CreateVolume(ctx, volExtra, agentapi.VolumeSpec{SizeMiB: 32, Source: &agentapi.VolumeSource{Volume: volData}}); err != nil {
		t.Fatalf("clone: %v", err)
	}
	src, clone := volumeFile(t, a.StateDir, volData), volumeFile(t, a.StateDir, volExtra)
	qemuIO(t, src, "write -P 0x22 0 64k")
	qemuIO(t, clone, "write -P 0x33 64k 64k")
	if out := qemuIO(t, clone, "read -P 0x11 0 64k"); strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the clone sees the source's later write: %s", out)
	}
	if out := qemuIO(t, src, "read -P 0x00 64k 64k"); strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the source sees the clone's write: %s", out)
	}
	if err := a.Client.DeleteVolume(ctx, volData); err != nil {
		t.Fatal(err)
	}
	if out := qemuIO(t, clone, "read -P 0x11 0 64k"); strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the clone after its source's delete: %s", out)
	}
	if out, err := exec.Command("qemu-img", "check", "-q", clone).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check of the clone: %v: %s", err, out)
	}
	v, err := a.Client.GetVolume(ctx, volExtra)
	if err != nil || v.SizeMiB != 32 {
		t.Fatalf("clone = %+v, %v", v, err)
	}
}

// A move of a clone: the source agent sends one self-contained qcow2 (the
// frozen base folded in), the target takes it after checking its digest
// and that it names no backing file, and reads the clone's data.
func TestVolumeMoveFlattensTheChain(t *testing.T) {
	testenv.RequireQEMU(t)
	src := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	dst := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", Token: src.Token})
	ctx := context.Background()
	if _, err := src.Client.CreateVolume(ctx, volData, agentapi.VolumeSpec{SizeMiB: 16}); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, volumeFile(t, src.StateDir, volData), "write -P 0x44 0 64k")
	if _, err := src.Client.CreateVolume(ctx, volExtra, agentapi.VolumeSpec{SizeMiB: 16, Source: &agentapi.VolumeSource{Volume: volData}}); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, volumeFile(t, src.StateDir, volExtra), "write -P 0x55 64k 64k")
	key := agentapi.EncodeKey(src.PublicKey)
	v, err := dst.Client.CreateVolume(ctx, volExtra, agentapi.VolumeSpec{SizeMiB: 24,
		Source: &agentapi.VolumeSource{Peer: &agentapi.VolumePeer{Agent: src.Address, PublicKey: key}}})
	if err != nil || v.SizeMiB != 24 {
		t.Fatalf("pull the clone: %+v, %v", v, err)
	}
	moved := volumeFile(t, dst.StateDir, volExtra)
	out, err := exec.Command("qemu-img", "info", "--output=json", moved).Output()
	if err != nil || strings.Contains(string(out), "backing-filename") || !strings.Contains(string(out), `"virtual-size": 25165824`) {
		t.Fatalf("moved disk: %s, %v; want no backing file, 24 MiB", out, err)
	}
	for _, c := range []string{"read -P 0x44 0 64k", "read -P 0x55 64k 64k"} {
		if out := qemuIO(t, moved, c); strings.Contains(out, "Pattern verification failed") {
			t.Fatalf("moved disk %q: %s", c, out)
		}
	}
}
