package image_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// bundleOf writes a kernel bundle of the given files (name -> content;
// a content "@path" copies that file) and returns its path and sha256.
func bundleOf(t *testing.T, files map[string]string) (string, string) {
	t.Helper()
	folder := t.TempDir()
	for name, content := range files {
		if from, ok := strings.CutPrefix(content, "@"); ok {
			b, err := os.ReadFile(from)
			if err != nil {
				t.Fatal(err)
			}
			content = string(b)
		}
		if err := os.WriteFile(filepath.Join(folder, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tarPath := filepath.Join(t.TempDir(), "bundle.tar")
	return tarPath, testenv.BundleImage(t, folder, tarPath)
}

// A kernel bundle's image.json is read strictly: a key that encoding/json
// would match case-insensitively to "disk" or "kernel" (the hole: the
// installer checked lower-case keys of a map, the driver decoded a struct
// and took "DISK": "../../<host file>" as its disk), a key given twice, an
// unknown key, and a file name that is a path are each refused with the
// reason, and nothing of the bundle stays in the cache.
func TestBundleManifestIsStrict(t *testing.T) {
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	cases := []struct {
		name, manifest, want string
	}{
		{"upper-disk", `{"kind":"kernel","kernel":"vmlinux","DISK":"../../../../etc/hostname","disk_format":"raw"}`, `key "DISK"`},
		{"mixed-disk", `{"kind":"kernel","kernel":"vmlinux","Disk":"../../../../etc/hostname"}`, `key "Disk"`},
		{"fold-disk", `{"kind":"kernel","kernel":"vmlinux","diſk":"../../../../etc/hostname"}`, `key "diſk"`},
		{"upper-kernel", `{"kind":"kernel","kernel":"vmlinux","KERNEL":"../../../../etc/hostname"}`, `key "KERNEL"`},
		{"upper-initrd", `{"kind":"kernel","kernel":"vmlinux","INITRD":"../../../../etc/hostname"}`, `key "INITRD"`},
		{"twice", `{"kind":"kernel","kernel":"vmlinux","kernel":"../../../../etc/hostname"}`, `key "kernel" given twice`},
		{"unknown", `{"kind":"kernel","kernel":"vmlinux","backing":"x"}`, `unknown key "backing"`},
		{"dot-dot", `{"kind":"kernel","kernel":".."}`, `kernel "..": want the plain name`},
		{"trailing", `{"kind":"kernel","kernel":"vmlinux"} {"disk":"x"}`, "data after the JSON object"},
	}
	srvDir := t.TempDir()
	for _, c := range cases {
		tarPath, sha := bundleOf(t, map[string]string{"image.json": c.manifest, "vmlinux": "not a kernel"})
		if err := os.Rename(tarPath, filepath.Join(srvDir, c.name+".tar")); err != nil {
			t.Fatal(err)
		}
		c.want = "is not a kernel bundle (a tar of image.json and the files it names): image.json: " + c.want
		srv := testenv.StartImageServer(t, srvDir)
		src := agentapi.ImageSource{Name: c.name, SHA256: sha, SourceURL: srv.FileURL(c.name + ".tar"), Format: agentapi.ImageFormatKernel}
		_, err := a.Client.CreateVM(context.Background(), "vm-"+c.name, vmSpec(src))
		if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: create: %v; want a 4xx saying %q", c.name, err, c.want)
		}
		if st := imageStatus(t, a, sha); st.Status != agentapi.ImageFailed || !strings.Contains(st.Reason, c.want) {
			t.Errorf("%s: status %+v", c.name, st)
		}
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
		t.Fatalf("cache holds %v", left)
	}
	// The manifest the cache keeps is its own, written from the checked
	// fields: a good bundle's extra bytes in image.json do not survive.
	good := `{"kind":"kernel","kernel":"vmlinux","cmdline":"console=ttyS0",   "build":"b1"}`
	tarPath, sha := bundleOf(t, map[string]string{"image.json": good, "vmlinux": "kernel bytes"})
	src := agentapi.ImageSource{Name: "good", SHA256: sha, SourceURL: "file://" + tarPath, Format: agentapi.ImageFormatKernel}
	if _, err := a.Client.CreateVM(context.Background(), "vm-good", vmSpec(src)); err != nil {
		t.Fatalf("a good bundle: %v", err)
	}
	kept, err := os.ReadFile(filepath.Join(a.CacheDir(), "sha256", sha, "image.json"))
	if err != nil {
		t.Fatal(err)
	}
	if string(kept) == good || !strings.Contains(string(kept), `"name": "good"`) || !strings.Contains(string(kept), `"cmdline": "console=ttyS0"`) {
		t.Fatalf("the cache kept image.json:\n%s\nwant the agent's own manifest of the checked fields", kept)
	}
}

// The hole end to end on real QEMU: the busybox guest as a kernel bundle
// whose image.json adds "DISK": "<relative path to a host file>" with
// "disk_format": "raw". On the unfixed agent the VM boots with the host
// file under its disk (the guest reads it from /dev/vda); now the image
// fails with the reason and no VM, no QEMU and no overlay exist.
func TestQEMUCaseVariantBundleNeverReachesAVM(t *testing.T) {
	testenv.RequireQEMU(t)
	if testing.Short() {
		t.Skip("boots real guests")
	}
	busybox := filepath.Join(testenv.GuestImageDir(t), "busybox")
	cacheDir := t.TempDir()
	secret := filepath.Join(t.TempDir(), "agent-token")
	if err := os.WriteFile(secret, []byte("kvm-host-secret-7f3a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The image folder is <cache>/sha256/<digest>: as many "../" as it
	// has slashes lead from it to the root, whatever the digest.
	up := strings.Repeat("../", strings.Count(filepath.Join(cacheDir, "sha256", strings.Repeat("0", 64)), "/"))
	manifest := `{"kind":"kernel","kernel":"vmlinux","initrd":"initrd.img","cmdline":"console=ttyS0 panic=-1 loglevel=4",` +
		`"machine":"q35","min_memory_mib":64,"DISK":"` + up + strings.TrimPrefix(secret, "/") + `","disk_format":"raw"}`
	tarPath, sha := bundleOf(t, map[string]string{
		"image.json": manifest,
		"vmlinux":    "@" + filepath.Join(busybox, "vmlinux"),
		"initrd.img": "@" + filepath.Join(busybox, "initrd.img"),
	})
	srv := testenv.StartImageServer(t, filepath.Dir(tarPath))
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", CacheDir: cacheDir, ImageDir: t.TempDir(), ImageFetch: fastFetch})
	t.Cleanup(func() { killGuests(a) })
	src := agentapi.ImageSource{Name: "evil", SHA256: sha, SourceURL: srv.FileURL(filepath.Base(tarPath)), Format: agentapi.ImageFormatKernel}
	vm, err := a.Client.CreateVM(context.Background(), "evil-1", agentapi.VMSpec{Image: "evil", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, ImageSource: &src})
	if err == nil {
		t.Fatalf("a VM was made of a bundle whose image.json says \"DISK\": %q; pid %d; its disk is backed by the host file %s",
			up+strings.TrimPrefix(secret, "/"), vm.PID, secret)
	}
	want := `image.json: key "DISK": keys are exact and lower-case`
	if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), want) {
		t.Fatalf("create: %v; want a 4xx saying %q", err, want)
	}
	if entries, _ := os.ReadDir(filepath.Join(a.StateDir, "vms")); len(entries) != 0 {
		t.Fatalf("a refused image left %d vm directories", len(entries))
	}
	if left := cacheEntries(t, cacheDir); len(left) != 0 {
		t.Fatalf("cache holds %v", left)
	}
}

func killGuests(a *testenv.Agent) {
	dirs, _ := filepath.Glob(filepath.Join(a.StateDir, "vms", "*"))
	for _, dir := range dirs {
		for _, pid := range qemu.ProcessesOf(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
