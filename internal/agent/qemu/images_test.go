package qemu_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// An operator's image folder under --image-dir is read as strictly as a
// fetched bundle: a manifest whose file names leave the folder ("../x"), or
// that names a file under a key encoding/json would match to "disk"
// ("DISK"), is not an image: the agent does not list it and makes no VM of
// it, and says which key of which folder is wrong.
func TestOperatorManifestCannotNameFilesOutsideItsFolder(t *testing.T) {
	testenv.RequireQEMU(t)
	busybox := filepath.Join(testenv.GuestImageDir(t), "busybox")
	images := t.TempDir()
	// A disk beside the image folders: "../outside.qcow2" from any of them.
	testenv.WriteQCOW2(t, images, "outside.qcow2", 16)
	kernel := `"kind":"kernel","kernel":"vmlinux","initrd":"initrd.img","cmdline":"console=ttyS0 panic=-1 loglevel=4"`
	for name, manifest := range map[string]string{
		"good":      `{` + kernel + `}`,
		"dotdot":    `{` + kernel + `,"disk":"../outside.qcow2"}`,
		"upper":     `{` + kernel + `,"DISK":"../outside.qcow2"}`,
		"abs":       `{` + kernel + `,"disk":"` + filepath.Join(images, "outside.qcow2") + `"}`,
		"up-kernel": `{"kind":"kernel","KERNEL":"../good/vmlinux","kernel":"vmlinux","initrd":"initrd.img"}`,
	} {
		dir := filepath.Join(images, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{"vmlinux", "initrd.img"} {
			if err := os.Symlink(filepath.Join(busybox, f), filepath.Join(dir, f)); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "image.json"), []byte(manifest), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: images})
	info, err := a.Client.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Images, []string{"good"}) {
		t.Errorf("the agent lists images %v, want only [good]", info.Images)
	}
	for name, want := range map[string]string{
		"dotdot":    `disk "../outside.qcow2": want the plain name of a file in the image folder`,
		"upper":     `key "DISK": keys are exact and lower-case; did you mean "disk"?`,
		"abs":       `want the plain name of a file in the image folder`,
		"up-kernel": `key "KERNEL"`,
	} {
		spec := guest
		spec.Image = name
		vm, err := a.Client.CreateVM(context.Background(), "vm-"+name, spec)
		if err == nil {
			for _, pid := range processesOf(a, "vm-"+name) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			t.Errorf("image %s: a VM was made (pid %d) of a manifest that names a file outside its folder", name, vm.PID)
			continue
		}
		if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), filepath.Join(images, name)) {
			t.Errorf("image %s: create: %v; want the folder and %q", name, err, want)
		}
	}
	if entries, _ := os.ReadDir(filepath.Join(a.StateDir, "vms")); len(entries) != 0 {
		t.Fatalf("refused images left %d vm directories", len(entries))
	}
}
