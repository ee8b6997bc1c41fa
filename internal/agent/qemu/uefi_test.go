package qemu_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// uefiImageDir is an image folder of the test's own holding the
// debian-12-cloud-uefi image that make image-debian-cloud builds (found in
// KVM_IMAGE_DIR or <repo>/.cache/images; its disk hard-linked), named
// "uefi". Without it the test skips, or fails when KVM_REQUIRE_DEBIAN=1.
func uefiImageDir(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a real UEFI guest")
	}
	testenv.RequireQEMU(t)
	var src string
	for _, d := range []string{os.Getenv("KVM_IMAGE_DIR"), filepath.Join("..", "..", "..", ".cache", "images")} {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "debian-12-cloud-uefi", "image.json")); err == nil {
			src = filepath.Join(d, "debian-12-cloud-uefi")
			break
		}
	}
	if src == "" {
		if os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
			t.Fatal("no debian-12-cloud-uefi image, and KVM_REQUIRE_DEBIAN=1: make image-debian-cloud")
		}
		t.Skip("no debian-12-cloud-uefi image: make image-debian-cloud")
	}
	images := t.TempDir()
	dst := filepath.Join(images, "uefi")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"image.json", "disk.qcow2"} {
		if err := os.Link(filepath.Join(src, f), filepath.Join(dst, f)); err != nil {
			if err := os.Symlink(filepath.Join(src, f), filepath.Join(dst, f)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return images
}

// Secure Boot is enforced: a uefi VM with secure_boot runs OVMF's secboot
// firmware on q35 with SMM and the Microsoft-keyed variables, and that
// firmware refuses the image's unsigned GRUB (a VM without secure_boot
// boots it: the control API's cloud image test). QEMU holds the VM's own
// variable store, copied from the Microsoft-keyed template.
func TestSecureBootRefusesAnUnsignedBootloader(t *testing.T) {
	images := uefiImageDir(t)
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: images})
	spec := agentapi.VMSpec{Image: "uefi", VCPUs: 1, MemoryMiB: 512, DiskMiB: 2200, SecureBoot: true}
	vm, err := a.Client.CreateVM(context.Background(), "sb", spec)
	if err != nil {
		t.Fatal(err)
	}
	if vm.Firmware != agentapi.FirmwareUEFI || !vm.SecureBoot {
		t.Fatalf("vm firmware %q secure boot %v; want uefi with secure boot", vm.Firmware, vm.SecureBoot)
	}
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(vm.PID) + "/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Split(string(cmdline), "\x00")
	for _, want := range []string{"OVMF_CODE_4M.secboot.fd", ",smm=on", "driver=cfi.pflash01,property=secure,value=on",
		filepath.Join(a.StateDir, "vms", "sb", "efivars.fd")} {
		found := false
		for _, arg := range args {
			found = found || strings.Contains(arg, want)
		}
		if !found {
			t.Fatalf("qemu's command line lacks %q: %q", want, args)
		}
	}
	con := waitConsole(t, a, "sb", `failed to load Boot\d+ .*: (Access Denied|Security Violation)`, 1)
	if strings.Contains(con, "Welcome to GRUB") {
		t.Fatalf("the unsigned GRUB ran under Secure Boot; console:\n%s", con)
	}
	if err := a.Client.DeleteVM(context.Background(), "sb"); err != nil {
		t.Fatal(err)
	}
}
