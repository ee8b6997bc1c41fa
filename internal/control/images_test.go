package control_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// servedQCOW2 serves a small real qcow2 on 127.0.0.1 and returns the
// server, its URL and its sha256.
func servedQCOW2(t *testing.T) (*testenv.ImageServer, string, string) {
	t.Helper()
	dir := t.TempDir()
	path := testenv.WriteQCOW2(t, dir, "tiny.qcow2", 64)
	srv := testenv.StartImageServer(t, dir)
	return srv, srv.FileURL("tiny.qcow2"), testenv.FileSHA256(t, path)
}

// waitImageHost waits until the control API shows the image with status on host.
func waitImageHost(t *testing.T, c *testenv.Control, name, host, status string) api.Image {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		img, err := c.Client.GetImage(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range img.Hosts {
			if h.Host == host && h.Status == status {
				return img
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("image %s never %s on %s: %+v", name, status, host, img)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func imageVM(name, image, host string) api.VMCreate {
	return api.VMCreate{Name: name, Image: image, VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024, Host: host}
}

// Through the control API: the first VM on a host fetches, a second on it
// does not, a VM on another host pulls from the peer: one download in all;
// the image shows ready on both hosts with its sizes.
func TestImageFetchedOnceAcrossHosts(t *testing.T) {
	srv, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a, b := startSimAgent(t), startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	c.RegisterHost(t, "host-b", b.Address)
	ctx := context.Background()
	img, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "tiny", SourceURL: url, SHA256: sha, Format: "qcow2"})
	if err != nil {
		t.Fatal(err)
	}
	if len(img.Hosts) != 0 || img.SizeBytes != 0 {
		t.Fatalf("a new image without prefetch is on no host: %+v", img)
	}
	for i, host := range []string{"host-a", "host-a", "host-b"} {
		vm, err := c.Client.CreateVM(ctx, imageVM(fmt.Sprintf("vm-%d", i), "tiny", host), "")
		if err != nil {
			t.Fatalf("create on %s: %v", host, err)
		}
		if vm.ObservedState != api.StateRunning || vm.Image != "tiny" {
			t.Fatalf("vm: %+v", vm)
		}
		waitImageHost(t, c, "tiny", host, api.ImageReady)
	}
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads from the source = %d, want 1 (host-b pulls from host-a)", n)
	}
	img = waitImageHost(t, c, "tiny", "host-b", api.ImageReady)
	if img.VirtualSizeMiB != 64 || img.SizeBytes == 0 || len(img.Hosts) != 2 {
		// the sizes arrive with the next sync of the host monitor
		deadline := time.Now().Add(10 * time.Second)
		for (img.VirtualSizeMiB != 64 || len(img.Hosts) != 2) && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
			img, _ = c.Client.GetImage(ctx, "tiny")
		}
		if img.VirtualSizeMiB != 64 || img.SizeBytes == 0 || len(img.Hosts) != 2 {
			t.Fatalf("image: %+v", img)
		}
	}
}

// Two equal hosts, one holding the image: the VM lands there and the
// explanation says why; the dry run says so too.
func TestPlacementPrefersHostWithImage(t *testing.T) {
	_, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a, b := startSimAgent(t), startSimAgent(t)
	// host-a sorts first, so a tie would go to it: host-b holds the image.
	c.RegisterHost(t, "host-a", a.Address)
	c.RegisterHost(t, "host-b", b.Address)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "tiny", SourceURL: url, SHA256: sha, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	// Warm host-b's cache without a VM (a VM would make the hosts unequal).
	vm, err := c.Client.CreateVM(ctx, imageVM("seed", "tiny", "host-b"), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
	waitImageHost(t, c, "tiny", "host-b", api.ImageReady)

	dry, err := c.Client.Place(ctx, api.PlacementRequest{Image: "tiny", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if dry.Host != "host-b" || !strings.Contains(dry.Note, "image locality decided: host host-b already holds image tiny") {
		t.Fatalf("dry run: host %s note %q", dry.Host, dry.Note)
	}
	vm, err = c.Client.CreateVM(ctx, imageVM("placed", "tiny", ""), "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Host != "host-b" || vm.Placement == nil || !strings.Contains(vm.Placement.Note, "already holds image tiny") ||
		vm.Placement.Terms["image_local"] != 1 {
		t.Fatalf("vm on %s, placement %+v", vm.Host, vm.Placement)
	}
}

// Deleting an image that VMs use is 409 naming them; once they are gone
// the delete removes the hosts' copies too.
func TestDeleteImageInUse(t *testing.T) {
	_, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "tiny", SourceURL: url, SHA256: sha, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	vm, err := c.Client.CreateVM(ctx, imageVM("user-1", "tiny", ""), "")
	if err != nil {
		t.Fatal(err)
	}
	err = c.Client.DeleteImage(ctx, "tiny")
	if !errors.Is(err, client.ErrConflict) || !strings.Contains(err.Error(), "user-1 ("+vm.ID+")") {
		t.Fatalf("delete in use: %v", err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.DeleteImage(ctx, "tiny"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.GetImage(ctx, "tiny"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get after delete: %v", err)
	}
	if _, err := os.Stat(filepath.Join(a.CacheDir(), "sha256", sha)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the host still caches the deleted image: %v", err)
	}
}

// Bad input: each a clear 4xx, nothing registered or cached.
func TestImageBadInput(t *testing.T) {
	srv, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	ctx := context.Background()
	for _, tc := range []struct {
		in   api.ImageCreate
		want string
	}{
		{api.ImageCreate{Name: "x", SourceURL: "ftp://127.0.0.1/x", SHA256: sha, Format: "qcow2"}, `scheme "ftp" is not supported`},
		{api.ImageCreate{Name: "x", SourceURL: url, SHA256: "ABC", Format: "qcow2"}, "is not a sha256 digest"},
		{api.ImageCreate{Name: "x", SourceURL: url, SHA256: strings.ToUpper(sha), Format: "qcow2"}, "is not a sha256 digest"},
		{api.ImageCreate{Name: "x", SourceURL: url, SHA256: sha, Format: "vmdk"}, `format "vmdk" is not one of`},
		{api.ImageCreate{Name: "x", SourceURL: "file://relative/x", SHA256: sha, Format: "qcow2"}, "absolute path"},
		{api.ImageCreate{Name: "x", SourceURL: url, SHA256: sha, Format: "qcow2", Firmware: "efi"}, `firmware "efi" is not one of bios, uefi`},
		{api.ImageCreate{Name: "x", SourceURL: url, SHA256: sha, Format: "kernel", Firmware: "uefi"}, "firmware uefi boots a disk image"},
	} {
		_, err := c.Client.CreateImage(ctx, tc.in)
		var e *client.Error
		if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, tc.want) {
			t.Errorf("%+v: %v; want 400 saying %q", tc.in, err, tc.want)
		}
	}
	if list, err := c.Client.ListImages(ctx, client.ListOptions{}); err != nil || len(list.Items) != 0 {
		t.Fatalf("images after bad input: %+v %v", list, err)
	}

	// A format that does not match the file: the VM create fails with the
	// reason, the image shows failed on the host, and nothing is cached.
	raw := filepath.Join(t.TempDir(), "raw.img")
	if err := os.WriteFile(raw, []byte(strings.Repeat("x", 4096)), 0o644); err != nil {
		t.Fatal(err)
	}
	rawSHA := testenv.FileSHA256(t, raw)
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "liar", SourceURL: "file://" + raw, SHA256: rawSHA, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	_, err := c.Client.CreateVM(ctx, imageVM("liar-vm", "liar", ""), "")
	var e *client.Error
	if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "is not a qcow2 file") {
		t.Fatalf("create of a mismatched image: %v", err)
	}
	img := waitImageHost(t, c, "liar", "host-a", api.ImageFailed)
	if !strings.Contains(img.Hosts[0].Reason, "is not a qcow2 file") {
		t.Fatalf("reason: %+v", img.Hosts)
	}
	if _, err := os.Stat(filepath.Join(a.CacheDir(), "sha256", rawSHA)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a mismatched image was cached: %v", err)
	}
	if vms, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(vms) != 0 {
		t.Fatalf("vms after failed creates: %+v", vms)
	}

	// min_disk_mib above the VM's disk: 400 at VM create, nothing fetched.
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "big", SourceURL: url, SHA256: sha, Format: "qcow2", MinDiskMiB: 4096}); err != nil {
		t.Fatal(err)
	}
	_, err = c.Client.CreateVM(ctx, imageVM("small", "big", ""), "")
	if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "below the min_disk_mib 4096 of image big") {
		t.Fatalf("create below min_disk_mib: %v", err)
	}
	// secure_boot on an image that boots with bios: 400 at VM create,
	// naming the image and its firmware; nothing fetched.
	img, err = c.Client.CreateImage(ctx, api.ImageCreate{Name: "plain", SourceURL: url, SHA256: sha, Format: "qcow2"})
	if err != nil || img.Firmware != api.FirmwareBIOS {
		t.Fatalf("image without firmware: %+v, %v; want firmware bios", img, err)
	}
	sb := imageVM("sb", "plain", "")
	sb.SecureBoot = true
	_, err = c.Client.CreateVM(ctx, sb, "")
	if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "secure_boot needs an image with firmware uefi; image plain boots with firmware bios") {
		t.Fatalf("secure boot on a bios image: %v", err)
	}
	if n := srv.Requests(); n != 0 {
		t.Fatalf("the source was asked %d times for refused creates", n)
	}
}

// Prefetch: every host fetches at once; a change of min_disk_mib is in place.
func TestImagePrefetchAndUpdate(t *testing.T) {
	srv, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a, b := startSimAgent(t), startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	c.RegisterHost(t, "host-b", b.Address)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "tiny", SourceURL: url, SHA256: sha, Format: "qcow2", Prefetch: true}); err != nil {
		t.Fatal(err)
	}
	waitImageHost(t, c, "tiny", "host-a", api.ImageReady)
	waitImageHost(t, c, "tiny", "host-b", api.ImageReady)
	if srv.Downloads() > 2 {
		t.Fatalf("downloads = %d, want at most one per host", srv.Downloads())
	}
	minDisk := int64(2048)
	img, err := c.Client.UpdateImage(ctx, "tiny", api.ImagePatch{MinDiskMiB: &minDisk})
	if err != nil || img.MinDiskMiB != 2048 || img.SHA256 != sha {
		t.Fatalf("update: %+v %v", img, err)
	}
}

// A fork of a VM of a registered image spills a child to a host that does
// not hold the image: that host fetches it from the source's host (one
// download in all) and starts the child from the pulled snapshot.
func TestForkOfRegisteredImageSpills(t *testing.T) {
	srv, url, sha := servedQCOW2(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	// host-a holds the source and one child (256 MiB each), no more.
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 600, DiskMiB: 102400})
	b := startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	c.RegisterHost(t, "host-b", b.Address)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "tiny", SourceURL: url, SHA256: sha, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	src, err := c.Client.CreateVM(ctx, imageVM("fork-source", "tiny", "host-a"), "")
	if err != nil {
		t.Fatal(err)
	}
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for f.Phase != api.ForkReady && f.Phase != api.ForkFailed && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		if f, err = c.Client.GetFork(ctx, f.ID); err != nil {
			t.Fatal(err)
		}
	}
	if f.Phase != api.ForkReady || len(f.Children) != 2 {
		t.Fatalf("fork: phase %s error %q children %d", f.Phase, f.Error, len(f.Children))
	}
	hosts := map[string]bool{}
	for _, ch := range f.Children {
		hosts[ch.Host] = true
		if ch.ObservedState != api.StateRunning || ch.Image != "tiny" {
			t.Fatalf("child %+v", ch)
		}
	}
	if !hosts["host-b"] {
		t.Fatalf("no child spilled to host-b: %v", hosts)
	}
	waitImageHost(t, c, "tiny", "host-b", api.ImageReady)
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads from the source = %d, want 1", n)
	}
	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
}
