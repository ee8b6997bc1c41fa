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
// QEMU binary, not per agent (tests restart agents often).
var (
	probeMu    sync.Mutex
	probeCache = map[string]error{}
)

// chooseAccel picks the accelerator: tcg when asked, kvm when asked (and it
// works), and for auto kvm only if a probe guest really runs under it.
func chooseAccel(ctx context.Context, bin, want string) (string, string, error) {
	switch want {
	case "tcg":
		return "tcg", "tcg requested (--accel tcg)", nil
	case "kvm", "auto", "":
	default:
		return "", "", fmt.Errorf("unknown accel %q: want auto, kvm or tcg", want)
	}
	probeMu.Lock()
	probeErr, ok := probeCache[bin]
	if !ok {
		probeErr = probeKVM(ctx, bin)
		if ctx.Err() == nil { // a cancelled probe says nothing about KVM
			probeCache[bin] = probeErr
		}
	}
	probeMu.Unlock()
	if probeErr == nil {
		return "kvm", "kvm probe guest ran", nil
	}
	if want == "kvm" {
		return "", "", fmt.Errorf("--accel kvm, but KVM cannot run guests here: %w; use --accel auto or tcg", probeErr)
	}
	return "tcg", fmt.Sprintf("kvm unusable (%v): using tcg", probeErr), nil
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
