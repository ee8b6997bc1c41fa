package control_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// cloudImageDir is the folder of a partitioned cloud image that make
// image-debian-cloud builds (debian-12-cloud-bios, debian-12-cloud-uefi),
// looked up in $KVM_DEBIAN_IMAGE_DIR, $KVM_IMAGE_DIR, then
// <repo>/.cache/images. Without it the test skips, or fails when
// KVM_REQUIRE_DEBIAN=1 (CI builds it).
func cloudImageDir(t *testing.T, name string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a real Debian guest")
	}
	var dirs []string
	for _, env := range []string{"KVM_DEBIAN_IMAGE_DIR", "KVM_IMAGE_DIR"} {
		if d := os.Getenv(env); d != "" {
			dirs = append(dirs, d)
		}
	}
	dirs = append(dirs, filepath.Join("..", "..", ".cache", "images"))
	for _, d := range dirs {
		folder := filepath.Join(d, name)
		if _, err := os.Stat(filepath.Join(folder, "image.json")); err == nil {
			return folder
		}
	}
	if os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
		t.Fatalf("no %s image, and KVM_REQUIRE_DEBIAN=1: `make test` builds it after debian-12 (make image-debian-cloud)", name)
	}
	t.Skipf("no %s image: build it with `make image-debian-cloud` (or set KVM_DEBIAN_IMAGE_DIR to the folder holding it)", name)
	return ""
}

// registerCloudImage serves the disk of an image folder on 127.0.0.1 and
// registers it as qcow2 under each name with its firmware ("" for the
// default).
func registerCloudImage(t *testing.T, c *testenv.Control, folder string, firmwareOf map[string]string) {
	t.Helper()
	served := t.TempDir()
	if err := os.Link(filepath.Join(folder, "disk.qcow2"), filepath.Join(served, "disk.qcow2")); err != nil {
		t.Fatal(err)
	}
	sha := testenv.FileSHA256(t, filepath.Join(served, "disk.qcow2"))
	srv := testenv.StartImageServer(t, served)
	for name, fw := range firmwareOf {
		if _, err := c.Client.CreateImage(context.Background(), api.ImageCreate{Name: name, SourceURL: srv.FileURL("disk.qcow2"),
			SHA256: sha, Format: api.ImageFormatQCOW2, MinDiskMiB: 2200, Firmware: fw}); err != nil {
			t.Fatal(err)
		}
	}
}

// cloudVM is a Debian guest of image with one forward to its SSH port.
func cloudVM(name, image, host string, key testenv.GuestKey) api.VMCreate {
	return api.VMCreate{Name: name, Image: image, Host: host, VCPUs: 2, MemoryMiB: 1024, DiskMiB: 4096,
		UserData:          "#cloud-config\nwrite_files:\n- path: /etc/kvm-test.txt\n  content: written for " + name + "\n",
		SSHAuthorizedKeys: []string{key.Authorized},
		NetworkInterfaces: []api.NetworkInterface{{Network: api.DefaultNetwork, PortForwards: []api.PortForward{{GuestPort: 22}}}}}
}

// The UEFI-only cloud image (GPT, an EFI system partition, no BIOS boot
// code) through the product: registered without firmware = "uefi" its VM
// is refused at create with the reason and what to set, before anything
// boots; registered with it, the guest boots under OVMF to SSH, its root
// grown to the VM's disk by cloud-init; a fork of it has a child on its
// host and one on another (which pulls the snapshot), each running with
// its own copy of the source's UEFI variables.
func TestQEMUUEFICloudImageBootsForksAndRefusesBIOS(t *testing.T) {
	folder := cloudImageDir(t, "debian-12-cloud-uefi")
	key := testenv.NewGuestKey(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	// Room for the source and a child on h1 and a child on h2, whatever
	// this machine's own cores (the children only resume).
	h1 := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir(), VCPUs: 8})
	h2 := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir(), VCPUs: 8})
	c.RegisterHost(t, "h1", h1.Address)
	c.RegisterHost(t, "h2", h2.Address)
	registerCloudImage(t, c, folder, map[string]string{"debian-uefi": api.FirmwareUEFI, "debian-uefi-as-bios": ""})
	ctx := context.Background()

	_, err := c.Client.CreateVM(ctx, cloudVM("as-bios", "debian-uefi-as-bios", "h1", key), "")
	var e *client.Error
	if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "image debian-uefi-as-bios is UEFI-only") ||
		!strings.Contains(e.Message, `set firmware = "uefi"`) {
		t.Fatalf("create of a UEFI-only image registered as bios: %v; want 400 saying it is UEFI-only and to set firmware = \"uefi\"", err)
	}
	if vms, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(vms) != 0 {
		t.Fatalf("vms after the refused create: %+v", vms)
	}

	start := time.Now()
	vm, err := c.Client.CreateVM(ctx, cloudVM("uefi-src", "debian-uefi", "h1", key), "")
	if err != nil {
		t.Fatal(err)
	}
	done := c.WaitCloudInitDone(t, vm.ID, start)
	out := testenv.GuestSSH(t, vm, key, "test -d /sys/firmware/efi && echo uefi; cat /etc/kvm-test.txt; df -BM --output=size / | tail -1", nil)
	t.Logf("uefi cloud guest under %s: cloud-init done %.1fs after the create began; ssh: %q", hostAccel(t, c), done.Seconds(), out)
	lines := strings.Fields(out)
	if len(lines) < 5 || lines[0] != "uefi" || !strings.Contains(out, "written for uefi-src") {
		t.Fatalf("guest says %q; want it booted by UEFI (/sys/firmware/efi) with its user data", out)
	}
	if size, _ := strconv.Atoi(strings.TrimSuffix(lines[len(lines)-1], "M")); size < 3500 {
		t.Fatalf("root file system is %s; want it grown to the 4096 MiB disk (growpart, resize2fs)", lines[len(lines)-1])
	}
	srcVars, err := os.ReadFile(filepath.Join(h1.StateDir, "vms", vm.ID, "efivars.fd"))
	if err != nil {
		t.Fatalf("the uefi vm has no variable store beside its disk: %v", err)
	}

	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 2, Placement: api.PlacementSpread}, "")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Minute)
	for f.Phase != api.ForkReady && f.Phase != api.ForkFailed && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		if f, err = c.Client.GetFork(ctx, f.ID); err != nil {
			t.Fatal(err)
		}
	}
	if f.Phase != api.ForkReady || len(f.Children) != 2 {
		t.Fatalf("fork of the uefi guest: phase %s error %q children %d", f.Phase, f.Error, len(f.Children))
	}
	agents := map[string]*testenv.Agent{"h1": h1, "h2": h2}
	hosts := map[string]bool{}
	for _, ch := range f.Children {
		hosts[ch.Host] = true
		if ch.ObservedState != api.StateRunning {
			t.Fatalf("child %s is %s: %s", ch.Name, ch.ObservedState, ch.Reason)
		}
		// The child runs on its source's firmware, with its own copy of
		// the variables the snapshot took (pulled with the disks on h2).
		a := agents[ch.Host]
		snapVars, err := os.ReadFile(filepath.Join(a.StateDir, "snapshots", f.ID, "efivars.fd"))
		if err != nil {
			t.Fatalf("host %s has no uefi variables in snapshot %s: %v", ch.Host, f.ID, err)
		}
		childVars, err := os.ReadFile(filepath.Join(a.StateDir, "vms", ch.ID, "efivars.fd"))
		if err != nil {
			t.Fatalf("child %s on %s has no variable store: %v", ch.Name, ch.Host, err)
		}
		if len(childVars) != len(srcVars) || !bytes.Equal(childVars, snapVars) {
			t.Fatalf("child %s on %s: variables (%d bytes) are not the snapshot's copy (%d bytes)", ch.Name, ch.Host, len(childVars), len(snapVars))
		}
		out := testenv.GuestSSH(t, ch, key, "test -d /sys/firmware/efi && echo uefi; cat /etc/kvm-test.txt", nil)
		if !strings.HasPrefix(out, "uefi\n") || !strings.Contains(out, "written for uefi-src") {
			t.Fatalf("child %s on %s says %q; want the source's uefi guest", ch.Name, ch.Host, out)
		}
	}
	if !hosts["h1"] || !hosts["h2"] {
		t.Fatalf("children on %v; want one on the source's host and one pulled to the other", hosts)
	}
	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}

// The BIOS cloud image (MBR, a FAT boot partition with syslinux) boots
// through the product to SSH under SeaBIOS, its root grown to the disk.
func TestQEMUBIOSCloudImageBootsToSSH(t *testing.T) {
	folder := cloudImageDir(t, "debian-12-cloud-bios")
	key := testenv.NewGuestKey(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir()})
	c.RegisterHost(t, "h1", a.Address)
	registerCloudImage(t, c, folder, map[string]string{"debian-bios": ""})
	ctx := context.Background()
	start := time.Now()
	vm, err := c.Client.CreateVM(ctx, cloudVM("bios-ssh", "debian-bios", "", key), "")
	if err != nil {
		t.Fatal(err)
	}
	done := c.WaitCloudInitDone(t, vm.ID, start)
	out := testenv.GuestSSH(t, vm, key, "test -d /sys/firmware/efi || echo bios; cat /etc/kvm-test.txt; df -BM --output=size / | tail -1", nil)
	t.Logf("bios cloud guest under %s: cloud-init done %.1fs after the create began; ssh: %q", hostAccel(t, c), done.Seconds(), out)
	lines := strings.Fields(out)
	if len(lines) < 5 || lines[0] != "bios" || !strings.Contains(out, "written for bios-ssh") {
		t.Fatalf("guest says %q; want it booted by BIOS with its user data", out)
	}
	if size, _ := strconv.Atoi(strings.TrimSuffix(lines[len(lines)-1], "M")); size < 3500 {
		t.Fatalf("root file system is %s; want it grown to the 4096 MiB disk", lines[len(lines)-1])
	}
	if _, err := os.Stat(filepath.Join(a.StateDir, "vms", vm.ID, "efivars.fd")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a bios vm has uefi variables: %v", err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}

// hostAccel is the accelerator of the test's one host (kvm or tcg).
func hostAccel(t *testing.T, c *testenv.Control) string {
	t.Helper()
	hosts, err := c.Client.AllHosts(context.Background())
	if err != nil || len(hosts) == 0 {
		return "unknown"
	}
	return hosts[0].Accel
}
