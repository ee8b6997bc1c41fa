package cmd

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// kvmd dev registers the image folders of its image directory (busybox,
// as make image builds it) as images like any other; a VM of one makes the
// local agent fetch the bundle into its cache, verified by its digest.
func TestRunDevRegistersImageFolders(t *testing.T) {
	imageDir := t.TempDir()
	folder := filepath.Join(imageDir, "busybox")
	if err := os.MkdirAll(folder, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{
		"image.json": `{"kind": "kernel", "kernel": "vmlinux", "initrd": "initrd.img", "cmdline": "console=ttyS0"}`,
		"vmlinux":    "not a real kernel: the sim driver never reads it",
		"initrd.img": "nor a real initrd",
	} {
		if err := os.WriteFile(filepath.Join(folder, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	addr := freeAddress(t)
	env := map[string]string{"KVMD_TOKEN": "dev-token"}
	args := []string{"--listen", addr, "--data-dir", t.TempDir(), "--driver", "sim", "--image-dir", imageDir}
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- runDev(ctx, args, func(k string) string { return env[k] }, &logs) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("runDev after cancel: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Error("runDev did not return after its context ended")
		}
	}()

	c := client.New(addr, "dev-token", client.WithTimeout(10*time.Second), client.WithRetries(0, 0))
	var img api.Image
	var err error
	for range 400 {
		if img, err = c.GetImage(ctx, "busybox"); err == nil {
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	if err != nil || img.Format != api.ImageFormatKernel || img.SourceURL == "" {
		t.Fatalf("image busybox = %+v, %v; logs:\n%s", img, err, logs.String())
	}
	vm, err := c.CreateVM(ctx, api.VMCreate{Name: "bb", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}, "")
	if err != nil || vm.ObservedState != api.StateRunning {
		t.Fatalf("create of the registered busybox: %+v %v; logs:\n%s", vm, err, logs.String())
	}
	if _, err := os.Stat(filepath.Join(imageDir, "sha256", img.SHA256, "image.json")); err != nil {
		t.Fatalf("the local agent did not cache the image: %v", err)
	}
}
