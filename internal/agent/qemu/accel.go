package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	imagecache "github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
)

// probeTimeout bounds the KVM probe guest. A working KVM runs it in well
// under a second; nested KVM that opens but hangs guests never finishes.
const probeTimeout = 5 * time.Second

// probeExit is QEMU's exit status when the probe guest ran: isa-debug-exit
// exits with (value << 1) | 1, and the probe writes 0x2a.
const probeExit = 0x2a<<1 | 1

// probeROM is a 64 KiB firmware image whose reset vector writes 0x2a to the
// isa-debug-exit port: if QEMU exits with probeExit, guest code really ran.
func probeROM() []byte {
	rom := bytes.Repeat([]byte{0xf4}, 64<<10) // hlt
	code := []byte{
		0xb0, 0x2a, // mov al, 0x2a
		0xe6, 0xf4, // out 0xf4, al
		0xf4,       // hlt
		0xeb, 0xfd, // jmp back to hlt
	}
	copy(rom[0xfff0:], code) // the x86 reset vector, 16 bytes below 1 MiB
	return rom
}

// The probe answer does not change while the process runs: probe once per
// QEMU binary and kernel, not per agent (tests restart agents often).
var (
	probeMu    sync.Mutex
	probeCache = map[string]error{}
)

// linuxProbeTimeout bounds the boot of a Linux kernel under KVM to its
// panic for want of a root file system: about a second where KVM works
// (six under TCG here), forever where a nested KVM runs the probe ROM but
// spins on a Linux guest ("KVM internal error ... emulation failure").
var linuxProbeTimeout = 30 * time.Second

// chooseAccel picks the accelerator: tcg when asked, kvm when asked (and it
// works), and for auto kvm only if probe guests really run under it: the
// probe ROM, then, when kernel names one (a kernel of the image folder), a
// Linux kernel booted to its first panic.
func chooseAccel(ctx context.Context, bin, want, kernel string) (string, string, error) {
	switch want {
	case "tcg":
		return "tcg", "tcg requested (--accel tcg)", nil
	case "kvm", "auto", "":
	default:
		return "", "", fmt.Errorf("unknown accel %q: want auto, kvm or tcg", want)
	}
	probeMu.Lock()
	key := bin + "\x00" + kernel
	probeErr, ok := probeCache[key]
	if !ok {
		probeErr = probeKVM(ctx, bin)
		if probeErr == nil && kernel != "" {
			probeErr = probeLinux(ctx, bin, "kvm", kernel)
		}
		if ctx.Err() == nil { // a cancelled probe says nothing about KVM
			probeCache[key] = probeErr
		}
	}
	probeMu.Unlock()
	if probeErr == nil {
		if kernel != "" {
			return "kvm", "kvm probe guest and a Linux kernel ran", nil
		}
		return "kvm", "kvm probe guest ran (no kernel image to boot-test)", nil
	}
	if want == "kvm" {
		return "", "", fmt.Errorf("--accel kvm, but KVM cannot run guests here: %w; use --accel auto or tcg", probeErr)
	}
	return "tcg", fmt.Sprintf("kvm unusable (%v): using tcg", probeErr), nil
}

// probeLinux boots kernel under accel with no root file system: a kernel
// that runs panics at the mount of its root, and with panic=-1 and
// -no-reboot QEMU then exits 0. Anything else (no exit within
// linuxProbeTimeout, another status) means Linux guests do not run.
func probeLinux(ctx context.Context, bin, accel, kernel string) error {
	ctx, cancel := context.WithTimeout(ctx, linuxProbeTimeout)
	defer cancel()
	args := []string{"-accel", accel, "-machine", "q35", "-m", "256", "-nodefaults", "-no-user-config", "-display", "none",
		"-serial", "stdio", "-no-reboot", "-kernel", kernel, "-append", "console=ttyS0 panic=-1 loglevel=1"}
	if accel == "kvm" {
		args = append(args, "-cpu", "host")
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("the Linux kernel %s did not boot under %s in %s (guests hang)", kernel, accel, linuxProbeTimeout)
	case err != nil:
		return fmt.Errorf("the Linux kernel %s under %s: %v: %s", kernel, accel, err, lastLine(out.String()))
	}
	return nil
}

// lastLine is the last non-empty line of s.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// probeKernel is the kernel of the first kernel image (by folder name) in
// dir, for probeLinux; "" when there is none.
func probeKernel(dir string) string {
	if dir == "" {
		return ""
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return ""
	}
	for _, e := range entries {
		m, err := imagecache.ReadManifest(filepath.Join(dir, e.Name()))
		if err != nil || m.Kind != agent.ImageKernel || m.Kernel == "" {
			continue
		}
		if k := filepath.Join(dir, e.Name(), m.Kernel); fileExists(k) {
			return k
		}
	}
	return ""
}

func probeKVM(ctx context.Context, bin string) error {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open /dev/kvm: %w", err)
	}
	_ = f.Close()
	dir, err := os.MkdirTemp("", "kvmd-kvm-probe-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	rom := filepath.Join(dir, "probe.rom")
	if err := os.WriteFile(rom, probeROM(), 0o600); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	// -cpu host, as VMs get under KVM: a nested KVM may run the probe
	// with a default CPU and then refuse the host CPU's MSRs.
	cmd := exec.CommandContext(ctx, bin, "-accel", "kvm", "-cpu", "host", "-machine", "pc", "-nodefaults", "-no-user-config",
		"-display", "none", "-bios", rom, "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("a probe guest under kvm did not finish in %s (guests hang)", probeTimeout)
	case errors.As(err, &exit) && exit.ExitCode() == probeExit:
		return nil
	case err != nil:
		return fmt.Errorf("probe guest under kvm: %v: %s", err, strings.TrimSpace(out.String()))
	}
	return errors.New("probe guest under kvm exited without running its code")
}
