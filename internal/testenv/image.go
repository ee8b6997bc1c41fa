package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"
)

// guestImageName is the demo image scripts/build-image.sh builds.
const guestImageName = "busybox"

var guestImage struct {
	sync.Mutex
	dir string
}

// moduleRoot is the module's root directory (found from this file's path).
func moduleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// RequireQEMU skips t, saying what to install, when qemu-system-x86_64 is
// not on PATH: make test on a machine without QEMU runs everything else.
// With KVM_REQUIRE_QEMU=1 (as .ci/run sets) it fails t instead, so that CI
// never passes by skipping the real guests. With KVM_SKIP_QEMU_GUEST=1 (as
// make testacc-tofu sets: the provider's tests under OpenTofu) it skips t
// whatever is installed.
func RequireQEMU(t testing.TB) {
	t.Helper()
	if os.Getenv("KVM_SKIP_QEMU_GUEST") == "1" {
		t.Skip("KVM_SKIP_QEMU_GUEST=1 (make testacc-tofu): this test runs a real QEMU guest, whose subject is the guest, " +
			"not the CLI; make test runs it under Terraform")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err == nil {
		return
	}
	msg := "testenv: qemu-system-x86_64 is not on PATH, so this real-QEMU test skips; " +
		"scripts/deps.sh test installs QEMU (as root) or prints the apt-get command"
	if os.Getenv("KVM_REQUIRE_QEMU") == "1" {
		t.Fatal(msg + " (KVM_REQUIRE_QEMU=1: failing instead)")
	}
	t.Skip(msg)
}

// GuestImageDir returns an image directory holding the busybox guest image
// (guestImageName), building it once per machine into $KVM_IMAGE_DIR or
// <repo>/.cache/images. A file lock keeps parallel test packages from
// building it twice at once. It skips the test when QEMU is not installed
// (see RequireQEMU) and fails it when the image cannot be built.
func GuestImageDir(t testing.TB) string {
	t.Helper()
	RequireQEMU(t)
	guestImage.Lock()
	defer guestImage.Unlock()
	if guestImage.dir != "" {
		return guestImage.dir
	}
	dir := os.Getenv("KVM_IMAGE_DIR")
	if dir == "" {
		dir = filepath.Join(moduleRoot(), ".cache", "images")
	}
	// KVM_IMAGE_PREBUILT=1: the folder holds a copy of the image built
	// elsewhere, on a machine without apt or the build script (a test's
	// binary run inside a guest, as internal/agent/qemu/cgrouptest does).
	if os.Getenv("KVM_IMAGE_PREBUILT") == "1" {
		if _, err := os.Stat(filepath.Join(dir, guestImageName, "image.json")); err != nil {
			t.Fatalf("testenv: KVM_IMAGE_PREBUILT=1 but %s has no %s image: %v", dir, guestImageName, err)
		}
	} else if err := buildGuestImage(dir); err != nil {
		t.Fatalf("testenv: build the guest image into %s: %v", dir, err)
	}
	guestImage.dir = dir
	return dir
}

func buildGuestImage(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer func() { _ = lock.Close() }()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer func() { _ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) }()
	// Downloading the kernel package takes seconds to minutes; the script
	// does nothing when the image is up to date.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(moduleRoot(), "scripts", "build-image.sh"), dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("scripts/build-image.sh: %w\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, guestImageName, "image.json")); err != nil {
		return fmt.Errorf("scripts/build-image.sh wrote no %s/image.json: %w\n%s", guestImageName, err, out)
	}
	return nil
}

// Accel is the QEMU accelerator of tests with real guests: tcg, unless
// KVM_TEST_ACCEL says otherwise (auto or kvm on a host whose KVM runs
// guests). Nested KVM can pass a probe and still hang guests, so tests do
// not trust auto by default; TestChooseAccel covers the probe itself.
func Accel() string {
	if a := os.Getenv("KVM_TEST_ACCEL"); a != "" {
		return a
	}
	return "tcg"
}
