package qemu

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// A VM with guest_agent gets a virtio-serial bus, a unix socket chardev
// inside its own directory (a relative path: QEMU runs there) and the port
// qemu-guest-agent opens; a VM without it gets none of these, and its
// command line is the same as before except for them.
func TestQEMUArgsOfTheGuestAgentChannel(t *testing.T) {
	d := &Driver{accel: "tcg"}
	dir := t.TempDir()
	for _, machine := range []string{"q35", "microvm"} {
		img := &image{manifest: manifest{Name: "busybox", Kind: agent.ImageKernel, Kernel: "vmlinuz", Machine: machine}, dir: "/images/busybox"}
		m := &agent.Machine{ID: "vm-1", Dir: filepath.Join(dir, "vm-1"), Image: "busybox", VCPUs: 1, MemoryMiB: 128}
		without := d.args(m, img, agent.BootOptions{}, childFiles{}, nil, 0)
		m.GuestAgent = true
		with := d.args(m, img, agent.BootOptions{}, childFiles{}, nil, 0)
		for _, a := range without {
			if strings.Contains(a, "virtio-serial") || strings.Contains(a, "virtserialport") || strings.Contains(a, qgaFileName) {
				t.Errorf("%s without guest_agent: argument %q belongs to the guest agent channel", machine, a)
			}
		}
		bus := "virtio-serial-pci,id=qga-serial"
		if machine == "microvm" {
			bus = "virtio-serial-device,id=qga-serial"
		}
		want := []string{
			"-device", bus,
			"-chardev", "socket,id=qga,server=on,wait=off,path=qga.sock",
			"-device", "virtserialport,bus=qga-serial.0,chardev=qga,name=org.qemu.guest_agent.0",
		}
		i := slices.Index(with, bus) - 1 // its "-device"
		if i < 0 || i+len(want) > len(with) || !slices.Equal(with[i:i+len(want)], want) {
			t.Fatalf("%s with guest_agent: args %q; want %q in them", machine, with, want)
		}
		rest := slices.Concat(with[:i], with[i+len(want):])
		if !slices.Equal(rest, without) {
			t.Fatalf("%s: args with guest_agent less its channel\n%q\ndiffer from those without\n%q", machine, rest, without)
		}
		// The socket is named relative to QEMU's working directory, the
		// VM's own (sandbox.go): never a path outside it.
		for _, a := range want {
			if strings.Contains(a, "path=") && (strings.Contains(a, "/") || strings.Contains(a, "..")) {
				t.Fatalf("guest agent socket %q is not a plain name in the vm's directory", a)
			}
		}
	}
	// A comma in the name would start a new option: the quoting holds.
	if got := qemuOptQuote("a,b"); got != "a,,b" {
		t.Fatalf("qemuOptQuote(a,b) = %q", got)
	}
}
