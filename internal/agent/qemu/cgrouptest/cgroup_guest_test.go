// Package cgrouptest runs package qemu's cgroup test on a kernel whose
// cgroup v2 has the memory and cpu controllers, wherever the tests run.
//
// The agent limits each QEMU with cgroup v2 (memory.max, cpu.max). A host
// that binds memory and cpu to cgroup v1 (a hybrid host, such as the
// machines this project's CI runs on) cannot show those limits working: a
// controller bound to a v1 hierarchy joins cgroup v2 only once that
// hierarchy is unmounted everywhere, which no test may do to its host. A
// Debian 12 guest has its own kernel with a unified cgroup v2 and both
// controllers, so the test boots one (the debian-12 image, under QEMU),
// copies into it package qemu's test binary, QEMU itself with the
// libraries and firmware it loads, and the busybox guest image, and runs
// TestGuestRunsInItsOwnCgroup there as root with KVM_REQUIRE_CGROUPS=1:
// the real agent starts a real (nested, TCG) QEMU in a cgroup of its own
// and the test reads its limits and its accounting back from the guest
// kernel.
package cgrouptest

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"context"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// inGuest is where the payload lands in the guest.
const inGuest = "/opt/kvmtest"

func TestGuestRunsInItsOwnCgroupOnAUnifiedKernel(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a real Debian guest and a QEMU inside it")
	}
	images := testenv.GuestImageDir(t)
	if _, err := os.Stat(filepath.Join(images, "debian-12", "image.json")); err != nil {
		if os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
			t.Fatalf("no debian-12 image in %s, and KVM_REQUIRE_DEBIAN=1: build it with `make image-debian` (make test does)", images)
		}
		t.Skipf("no debian-12 image in %s: build it with `make image-debian`", images)
	}
	key := testenv.NewGuestKey(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	h := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: images})
	c.RegisterHost(t, "h1", h.Address)
	ctx := context.Background()
	start := time.Now()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "unified", Image: "debian-12", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 4096,
		SSHAuthorizedKeys: []string{key.Authorized},
		NetworkInterfaces: []api.NetworkInterface{{Network: api.DefaultNetwork, PortForwards: []api.PortForward{{GuestPort: 22}}}}}, "")
	if err != nil {
		t.Fatal(err)
	}
	// The payload builds while the guest boots.
	payload := buildPayload(t, images)
	booted := c.WaitCloudInitDone(t, vm.ID, start)
	t.Logf("debian guest booted to cloud-init done in %s", booted.Round(time.Second))

	// The premise: this guest's kernel offers both controllers in cgroup v2.
	out := testenv.GuestSSH(t, vm, key, "uname -r; cat /sys/fs/cgroup/cgroup.controllers", nil)
	t.Logf("guest kernel and cgroup v2 controllers: %q", out)
	controllers := strings.Fields(out)
	if !hasAll(controllers, "memory", "cpu") {
		t.Fatalf("the debian-12 guest's cgroup v2 offers %q: want memory and cpu (a unified hierarchy, systemd's default in Debian 12)", out)
	}

	f, err := os.Open(payload)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	st, _ := f.Stat()
	copyStart := time.Now()
	testenv.GuestSSH(t, vm, key, "sudo tar -C / --skip-old-files -xzf -", bufio.NewReaderSize(f, 1<<20))
	t.Logf("copied %d MiB into the guest in %s", st.Size()>>20, time.Since(copyStart).Round(time.Second))

	run := strings.Join([]string{"sudo", "env",
		"LD_LIBRARY_PATH=" + inGuest + "/lib",
		"KVM_IMAGE_DIR=" + inGuest + "/images", "KVM_IMAGE_PREBUILT=1",
		"KVM_REQUIRE_QEMU=1", "KVM_REQUIRE_CGROUPS=1", "KVM_TEST_ACCEL=tcg",
		inGuest + "/qemu.test", "-test.run", "'^TestGuestRunsInItsOwnCgroup$'", "-test.v", "-test.count=1", "-test.timeout=15m",
	}, " ")
	runStart := time.Now()
	out = testenv.GuestSSH(t, vm, key, run+" 2>&1", nil)
	t.Logf("in the guest (%s):\n%s", time.Since(runStart).Round(time.Second), out)
	if !regexp.MustCompile(`(?m)^--- PASS: TestGuestRunsInItsOwnCgroup `).MatchString(out) {
		t.Fatalf("TestGuestRunsInItsOwnCgroup did not pass in the guest (see its output above)")
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}

func hasAll(have []string, want ...string) bool {
	for _, w := range want {
		found := false
		for _, h := range have {
			found = found || h == w
		}
		if !found {
			return false
		}
	}
	return true
}

// buildPayload writes a gzipped tar, to extract at / in the guest, of:
//   - inGuest/qemu.test: package qemu's test binary;
//   - /usr/bin: qemu-system-x86_64 and qemu-img from this host's PATH (the
//     guest has none), inGuest/lib: the libraries they load except glibc's
//     own (the guest's Debian 12 glibc is the one they were built for);
//   - /usr/share/qemu and /usr/share/seabios: the firmware QEMU loads from
//     its built-in data folder, and its TCG module from its module folder
//     (the tar is extracted with --skip-old-files);
//   - inGuest/images/busybox: the guest image the cgroup test starts.
func buildPayload(t *testing.T, images string) string {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "qemu.test")
	build := exec.Command("go", "test", "-c", "-ldflags=-s -w", "-o", bin, "github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu")
	build.Dir = repoRoot()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go test -c ./internal/agent/qemu: %v\n%s", err, out)
	}
	files := map[string]string{inGuest + "/qemu.test": bin} // in the guest -> on this host
	for _, name := range []string{"qemu-system-x86_64", "qemu-img"} {
		p, err := exec.LookPath(name)
		if err != nil {
			t.Fatal(err)
		}
		// In /usr/bin, as here: QEMU finds its firmware and modules
		// relative to its own folder.
		files["/usr/bin/"+name] = p
		for _, lib := range libraries(t, p) {
			files[inGuest+"/lib/"+filepath.Base(lib)] = lib
		}
	}
	// Debian's QEMU builds TCG as a module, loaded from its module folder.
	mods, _ := filepath.Glob("/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-*.so")
	for _, m := range mods {
		files[m] = m
		for _, lib := range libraries(t, m) {
			files[inGuest+"/lib/"+filepath.Base(lib)] = lib
		}
	}
	for _, d := range []string{"/usr/share/qemu", "/usr/share/seabios"} {
		addTree(t, files, d, d)
	}
	addTree(t, files, filepath.Join(images, "busybox"), inGuest+"/images/busybox")

	path := filepath.Join(dir, "payload.tar.gz")
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	zw, _ := gzip.NewWriterLevel(out, gzip.BestSpeed)
	tw := tar.NewWriter(zw)
	for dst, src := range files {
		if err := addFile(tw, dst, src); err != nil {
			t.Fatalf("payload: %s: %v", src, err)
		}
	}
	for _, c := range []io.Closer{tw, zw, out} {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

// glibc's own libraries: the guest's are used.
var glibc = regexp.MustCompile(`^(libc|libm|libpthread|libdl|librt|libresolv|ld-linux-x86-64)\.so`)

// libraries are the shared libraries bin loads, from ldd.
func libraries(t *testing.T, bin string) []string {
	t.Helper()
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", bin, err)
	}
	var libs []string
	for _, l := range strings.Split(string(out), "\n") {
		_, after, ok := strings.Cut(l, "=> ")
		if !ok {
			continue
		}
		p := strings.Fields(after)
		if len(p) == 0 || !strings.HasPrefix(p[0], "/") || glibc.MatchString(filepath.Base(p[0])) {
			continue
		}
		libs = append(libs, p[0])
	}
	return libs
}

// addTree adds every file under src (symbolic links followed) as dst/<rel>.
func addTree(t *testing.T, files map[string]string, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(src, p)
		files[filepath.Join(dst, rel)] = p
		return nil
	})
	if err != nil {
		t.Fatalf("payload: %v", err)
	}
}

// addFile writes src (its target, for a symbolic link) as dst, a path
// relative to /.
func addFile(tw *tar.Writer, dst, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if st.IsDir() {
		return nil
	}
	if err := tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(dst, "/"), Mode: int64(st.Mode().Perm()), Size: st.Size(),
		ModTime: st.ModTime(), Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}
