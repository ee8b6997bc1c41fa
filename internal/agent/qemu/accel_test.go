package qemu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The KVM probe is only as good as its guest: under TCG (which always runs
// guest code) the probe ROM must make QEMU exit with probeExit.
func TestProbeROMRunsUnderTCG(t *testing.T) {
	requireQEMU(t)
	rom := filepath.Join(t.TempDir(), "probe.rom")
	if err := os.WriteFile(rom, probeROM(), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-nodefaults", "-no-user-config",
		"-display", "none", "-bios", rom, "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != probeExit {
		t.Fatalf("probe guest under tcg: %v (%s), want exit status %d", err, out, probeExit)
	}
}

func TestChooseAccel(t *testing.T) {
	requireQEMU(t)
	ctx := context.Background()
	probeErr := probeKVM(ctx, "qemu-system-x86_64")
	accel, note, err := chooseAccel(ctx, "qemu-system-x86_64", "auto")
	if err != nil {
		t.Fatal(err)
	}
	if probeErr == nil && accel != "kvm" {
		t.Fatalf("auto with a working kvm chose %s (%s)", accel, note)
	}
	if probeErr != nil && (accel != "tcg" || !strings.Contains(note, probeErr.Error())) {
		t.Fatalf("auto without a working kvm: %s (%s), want tcg with the reason %q", accel, note, probeErr)
	}
	_, _, err = chooseAccel(ctx, "qemu-system-x86_64", "kvm")
	if (probeErr == nil) != (err == nil) {
		t.Fatalf("--accel kvm: %v, while the probe says %v", err, probeErr)
	}
	if accel, _, err := chooseAccel(ctx, "qemu-system-x86_64", "tcg"); err != nil || accel != "tcg" {
		t.Fatalf("--accel tcg: %s, %v", accel, err)
	}
	if _, _, err := chooseAccel(ctx, "qemu-system-x86_64", "hvf"); err == nil {
		t.Fatal("--accel hvf accepted")
	}
}

// requireQEMU is testenv.RequireQEMU for this internal test package (which
// cannot import testenv without a cycle).
func requireQEMU(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err == nil {
		return
	}
	msg := "qemu-system-x86_64 is not on PATH, so this real-QEMU test skips; " +
		"scripts/deps.sh test installs QEMU (as root) or prints the apt-get command"
	if os.Getenv("KVM_REQUIRE_QEMU") == "1" {
		t.Fatal(msg + " (KVM_REQUIRE_QEMU=1: failing instead)")
	}
	t.Skip(msg)
}
