package control_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// debianImageDir is the folder of the debian-12 image that make
// image-debian builds: $KVM_DEBIAN_IMAGE_DIR/debian-12, else
// $KVM_IMAGE_DIR/debian-12, else <repo>/.cache/images/debian-12; "" when
// none holds it.
func debianImageDir() string {
	var dirs []string
	if d := os.Getenv("KVM_DEBIAN_IMAGE_DIR"); d != "" {
		dirs = append(dirs, d)
	}
	if d := os.Getenv("KVM_IMAGE_DIR"); d != "" {
		dirs = append(dirs, d)
	}
	dirs = append(dirs, filepath.Join("..", "..", ".cache", "images"))
	for _, d := range dirs {
		folder := filepath.Join(d, "debian-12")
		if _, err := os.Stat(filepath.Join(folder, "image.json")); err == nil {
			return folder
		}
	}
	return ""
}

// A real Debian 12 guest (make image-debian) boots through the control API
// from a registered image: a kernel bundle of its folder, fetched and
// verified by the agent, and reaches its login prompt on the serial
// console (under TCG in about 1-3 minutes). One guest only.
func TestQEMUDebianGuestBoots(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a real Debian guest")
	}
	src := debianImageDir()
	if src == "" && os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
		t.Fatal("no debian-12 image, and KVM_REQUIRE_DEBIAN=1: `make test` builds it as root with mmdebstrap (make image-debian)")
	}
	if src == "" {
		t.Skip("no debian-12 image: build it with `make image-debian` (IMAGE_DIR=.cache/images, or set KVM_DEBIAN_IMAGE_DIR to the folder holding debian-12)")
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir()})
	c.RegisterHost(t, "h1", a.Address)
	served := t.TempDir()
	tarPath := filepath.Join(served, "debian-12.tar")
	sha := testenv.BundleImage(t, src, tarPath)
	srv := testenv.StartImageServer(t, served)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "debian-12", SourceURL: srv.FileURL("debian-12.tar"),
		SHA256: sha, Format: api.ImageFormatKernel, MinDiskMiB: 2048}); err != nil {
		t.Fatal(err)
	}
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "debian", Image: "debian-12", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 4096}, "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.ObservedState != api.StateRunning {
		t.Fatalf("vm: %+v", vm)
	}
	// getty's prompt starts a line; cloud-init may print on after it on the
	// same line.
	waitConsoleCount(t, a, vm.ID, `(?m)^\r?\S+ login: `, 1, 6*time.Minute)
	img, err := c.Client.GetImage(ctx, "debian-12")
	if err != nil || img.VirtualSizeMiB != 2048 || len(img.Hosts) != 1 || img.Hosts[0].Status != api.ImageReady {
		t.Fatalf("image after the boot: %+v %v", img, err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}
