package qemu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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
	accel, note, err := chooseAccel(ctx, "qemu-system-x86_64", "auto", "")
	if err != nil {
		t.Fatal(err)
	}
	if probeErr == nil && accel != "kvm" {
		t.Fatalf("auto with a working kvm chose %s (%s)", accel, note)
	}
	if probeErr != nil && (accel != "tcg" || !strings.Contains(note, probeErr.Error())) {
		t.Fatalf("auto without a working kvm: %s (%s), want tcg with the reason %q", accel, note, probeErr)
	}
	_, _, err = chooseAccel(ctx, "qemu-system-x86_64", "kvm", "")
	if (probeErr == nil) != (err == nil) {
		t.Fatalf("--accel kvm: %v, while the probe says %v", err, probeErr)
	}
	if accel, _, err := chooseAccel(ctx, "qemu-system-x86_64", "tcg", ""); err != nil || accel != "tcg" {
		t.Fatalf("--accel tcg: %s, %v", accel, err)
	}
	if _, _, err := chooseAccel(ctx, "qemu-system-x86_64", "hvf", ""); err == nil {
		t.Fatal("--accel hvf accepted")
	}
}

// The Linux probe guest: the image folder's kernel, booted with no root
// file system, panics and QEMU exits 0 (under TCG, which always runs
// guests); a file that is no kernel fails.
func TestLinuxProbeBootsAKernelToItsPanic(t *testing.T) {
	requireQEMU(t)
	kernel := probeKernel(os.Getenv("KVM_IMAGE_DIR"))
	if kernel == "" {
		msg := "no kernel image in KVM_IMAGE_DIR (make image builds one), so this test skips"
		if os.Getenv("KVM_REQUIRE_QEMU") == "1" {
			t.Fatal(msg + " (KVM_REQUIRE_QEMU=1: failing instead)")
		}
		t.Skip(msg)
	}
	if err := probeLinux(context.Background(), "qemu-system-x86_64", "tcg", kernel); err != nil {
		t.Fatalf("the kernel %s under tcg: %v", kernel, err)
	}
	notKernel := filepath.Join(t.TempDir(), "not-a-kernel")
	if err := os.WriteFile(notKernel, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := probeLinux(context.Background(), "qemu-system-x86_64", "tcg", notKernel); err == nil {
		t.Fatal("a file that is no kernel passed the Linux probe")
	}
}

// A nested KVM may run the probe ROM and yet hang every Linux guest (seen
// on the machines these tests run on: "KVM internal error. Suberror: 1",
// emulation failure, a guest spinning at 100 % system time). auto must
// then choose tcg and say why. The QEMU here is a fake, a script that
// runs the ROM (exits as the probe ROM does) and hangs on -kernel.
func TestAutoChoosesTCGWhenLinuxHangsUnderKVM(t *testing.T) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("the KVM probe opens /dev/kvm before it runs QEMU, and it cannot here (%v)", err)
	}
	_ = f.Close()
	dir := t.TempDir()
	fake := filepath.Join(dir, "fake-qemu-system-x86_64")
	script := "#!/bin/sh\ncase \"$*\" in\n*-bios*) exit " + strconv.Itoa(probeExit) + " ;;\n*-kernel*) exec sleep 60 ;;\nesac\nexit 1\n"
	if err := os.WriteFile(fake, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	kernel := filepath.Join(dir, "vmlinux")
	if err := os.WriteFile(kernel, []byte("kernel"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer func(d time.Duration) { linuxProbeTimeout = d }(linuxProbeTimeout)
	linuxProbeTimeout = time.Second
	accel, note, err := chooseAccel(context.Background(), fake, "auto", kernel)
	if err != nil || accel != "tcg" || !strings.Contains(note, "did not boot under kvm") {
		t.Fatalf("auto with a KVM that hangs Linux: %s (%s), %v; want tcg naming the hang", accel, note, err)
	}
	if _, _, err := chooseAccel(context.Background(), fake, "kvm", kernel); err == nil {
		t.Fatal("--accel kvm accepted a KVM that hangs Linux")
	}
	// The ROM alone (no kernel to boot-test) still says kvm.
	if accel, _, err := chooseAccel(context.Background(), fake, "auto", ""); err != nil || accel != "kvm" {
		t.Fatalf("auto with the ROM probe only: %s, %v; want kvm", accel, err)
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
