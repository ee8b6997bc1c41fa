package qcow2

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// qemuImgInfo is what qemu-img itself reads of a file's header.
type qemuImgInfo struct {
	Format          string `json:"format"`
	VirtualSize     int64  `json:"virtual-size"`
	BackingFilename string `json:"backing-filename"`
	BackingFormat   string `json:"backing-filename-format"`
}

// requireQemuImg skips without qemu-img, or fails with KVM_REQUIRE_QEMU=1
// (as CI sets); testenv.RequireQEMU is out of reach of this package's
// internal tests (testenv imports it).
func requireQemuImg(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		if os.Getenv("KVM_REQUIRE_QEMU") == "1" {
			t.Fatalf("qemu-img is not installed (KVM_REQUIRE_QEMU=1: failing instead of skipping): %v", err)
		}
		t.Skipf("qemu-img is not installed: %v", err)
	}
}

// qemuImgInfoOf is what qemu-img info reads of the qcow2 file at path.
func qemuImgInfoOf(t *testing.T, path string) qemuImgInfo {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "-f", "qcow2", "-U", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", path, err)
	}
	var i qemuImgInfo
	if err := json.Unmarshal(out, &i); err != nil {
		t.Fatal(err)
	}
	return i
}

func runQemuImg(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img %v: %v: %s", args, err, out)
	}
}

// The header reader agrees with qemu-img on every kind of file this driver
// makes or meets (both qcow2 versions, with and without a backing file and
// format, extended L2, lazy refcounts, a bitmap), and refuses, with a
// reason, what the driver must never adopt: an external data file,
// encryption (edited in: qemu-img's LUKS key setup times itself and fails
// on some hosts), a corrupt mark, unknown features and extensions, a cut or
// foreign file.
func TestQcow2HeaderMatchesQemuImg(t *testing.T) {
	requireQemuImg(t)
	t.Parallel()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	runQemuImg(t, "create", "-q", "-f", "qcow2", base, "32M")
	long := strings.Repeat("d", 200) + ".qcow2"
	accepted := map[string][]string{
		"plain":         {"create", "-q", "-f", "qcow2", "FILE", "64M"},
		"v2":            {"create", "-q", "-f", "qcow2", "-o", "compat=0.10", "FILE", "1G"},
		"backing":       {"create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "FILE", "64M"},
		"v2-backing":    {"create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-u", "-b", "../x/base.qcow2", "-F", "qcow2", "FILE", "64M"},
		"raw-backing":   {"create", "-q", "-f", "qcow2", "-u", "-b", "/etc/hostname", "-F", "raw", "FILE", "64M"},
		"json-backing":  {"create", "-q", "-f", "qcow2", "-u", "-b", `json:{"driver":"raw","file":{"filename":"/x"}}`, "-F", "raw", "FILE", "64M"},
		"long-backing":  {"create", "-q", "-f", "qcow2", "-u", "-b", long, "-F", "qcow2", "FILE", "64M"},
		"extended-l2":   {"create", "-q", "-f", "qcow2", "-o", "extended_l2=on", "FILE", "64M"},
		"lazy-refcount": {"create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", "-b", "base.qcow2", "-F", "qcow2", "FILE", "64M"},
		"small-cluster": {"create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "-b", "base.qcow2", "-F", "qcow2", "FILE", "8M"},
	}
	for name, args := range accepted {
		path := filepath.Join(dir, name+".qcow2")
		for i, a := range args {
			if a == "FILE" {
				args[i] = path
			}
		}
		runQemuImg(t, args...)
		if name == "plain" {
			// A persistent bitmap adds a header extension QEMU keeps.
			runQemuImg(t, "bitmap", "--add", path, "b0")
		}
		want := qemuImgInfoOf(t, path)
		got, err := ReadHeader(path)
		if err != nil {
			t.Errorf("%s: refused: %v", name, err)
			continue
		}
		if got.BackingFilename != want.BackingFilename || got.VirtualSize != want.VirtualSize {
			t.Errorf("%s: read backing %q, size %d; qemu-img reads %q, %d", name, got.BackingFilename, got.VirtualSize, want.BackingFilename, want.VirtualSize)
		}
		// qemu-img info guesses a format it was not given; the header's own
		// is what this reader reports.
		if want.BackingFilename != "" && got.BackingFormat != want.BackingFormat {
			t.Errorf("%s: backing format %q, qemu-img reads %q", name, got.BackingFormat, want.BackingFormat)
		}
	}

	// Made by qemu-img, refused.
	refused := map[string]struct {
		args []string
		why  string
	}{
		"data-file": {[]string{"create", "-q", "-f", "qcow2", "-o", "data_file=" + filepath.Join(dir, "data.raw"), "FILE", "64M"}, "external data file"},
		"raw":       {[]string{"create", "-q", "-f", "raw", "FILE", "1M"}, "no qcow2 magic"},
	}
	for name, c := range refused {
		path := filepath.Join(dir, name+".img")
		for i, a := range c.args {
			if a == "FILE" {
				c.args[i] = path
			}
		}
		runQemuImg(t, c.args...)
		if h, err := ReadHeader(path); err == nil || !strings.Contains(err.Error(), c.why) {
			t.Errorf("%s: read %+v, %v; want it refused for %q", name, h, err, c.why)
		}
	}

	// Edited headers, refused.
	good, err := os.ReadFile(filepath.Join(dir, "backing.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	headerLength := be.Uint32(good[100:])
	edits := map[string]struct {
		edit func(b []byte) []byte
		why  string
	}{
		"corrupt": {func(b []byte) []byte { be.PutUint64(b[72:], be.Uint64(b[72:])|incompatCorrupt); return b }, "corrupt"},
		"data-file-bit": {func(b []byte) []byte {
			be.PutUint64(b[72:], be.Uint64(b[72:])|incompatDataFile)
			return b
		}, "external data file"},
		"unknown-feature": {func(b []byte) []byte { be.PutUint64(b[72:], be.Uint64(b[72:])|1<<40); return b }, "unknown incompatible"},
		"unknown-extension": {func(b []byte) []byte {
			be.PutUint32(b[headerLength:], 0x12345678)
			return b
		}, "unknown header extension"},
		"encrypted": {func(b []byte) []byte { be.PutUint32(b[32:], 1); return b }, "encrypted (method 1)"},
		"encryption-header": {func(b []byte) []byte {
			be.PutUint32(b[headerLength:], extEncryption)
			return b
		}, "encryption header"},
		"version-4":      {func(b []byte) []byte { be.PutUint32(b[4:], 4); return b }, "version 4"},
		"cut":            {func(b []byte) []byte { return b[:90] }, "too short"},
		"long-backing":   {func(b []byte) []byte { be.PutUint32(b[16:], 1024); return b }, "backing file name of 1024 bytes"},
		"backing-far":    {func(b []byte) []byte { be.PutUint64(b[8:], 1<<20); return b }, "past the first cluster"},
		"extension-long": {func(b []byte) []byte { be.PutUint32(b[headerLength+4:], 1<<20); return b }, "runs past the first cluster"},
	}
	for name, c := range edits {
		b := c.edit(append([]byte(nil), good...))
		if h, err := Parse(b); err == nil || !strings.Contains(err.Error(), c.why) {
			t.Errorf("%s: read %+v, %v; want it refused for %q", name, h, err, c.why)
		}
	}
}

// FuzzParse: no header makes the reader panic, and what it
// accepts keeps QEMU's own limit on the backing file name.
func FuzzParse(f *testing.F) {
	seed := make([]byte, 512)
	be := binary.BigEndian
	be.PutUint32(seed[0:], magic)
	be.PutUint32(seed[4:], 3)
	be.PutUint32(seed[20:], 16)
	be.PutUint64(seed[24:], 64<<20)
	be.PutUint32(seed[100:], 112)
	be.PutUint32(seed[112:], extBackingFormat)
	be.PutUint32(seed[116:], 5)
	copy(seed[120:], "qcow2")
	be.PutUint64(seed[8:], 136)
	be.PutUint32(seed[16:], 10)
	copy(seed[136:], "disk.qcow2")
	f.Add(seed)
	f.Add(seed[:72])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := Parse(b)
		if err != nil {
			return
		}
		if len(h.BackingFilename) > MaxBackingName || strings.ContainsRune(h.BackingFilename, 0) {
			t.Fatalf("accepted backing name of %d bytes: %q", len(h.BackingFilename), h.BackingFilename)
		}
	})
}

// An overlay this driver writes is what qemu-img create makes: qemu-img
// info reads the same header, qemu-img check finds it clean, and after the
// same writes through QEMU's block layer (qemu-io) both overlays hold the
// same data, are still clean, and read the backing file where unwritten.
func TestQcow2OverlayMatchesQemuImgCreate(t *testing.T) {
	requireQemuImg(t)
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skipf("qemu-io is not installed: %v", err)
	}
	t.Parallel()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	runQemuImg(t, "create", "-q", "-f", "qcow2", base, "1G")
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 4M", "-c", "write -P 0x3c 40M 1M", base).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io on the base: %v: %s", err, out)
	}
	check := func(path string) {
		t.Helper()
		if out, err := exec.Command("qemu-img", "check", "-f", "qcow2", path).CombinedOutput(); err != nil {
			t.Errorf("qemu-img check %s: %v: %s", filepath.Base(path), err, out)
		}
	}
	for _, size := range []int64{64 << 20, 1 << 30, 5<<30 + 512, 8 << 40} {
		ours, theirs := filepath.Join(dir, "ours.qcow2"), filepath.Join(dir, "theirs.qcow2")
		if err := WriteOverlay(ours, "base.qcow2", size); err != nil {
			t.Fatal(err)
		}
		runQemuImg(t, "create", "-q", "-f", "qcow2", "-u", "-b", "base.qcow2", "-F", "qcow2", theirs, strconv.FormatInt(size, 10))
		if got, want := qemuImgInfoOf(t, ours), qemuImgInfoOf(t, theirs); got != want {
			t.Errorf("size %d: qemu-img info reads %+v, of qemu-img's own %+v", size, got, want)
		}
		check(ours)
		if _, err := os.Stat(ours + ".tmp"); !os.IsNotExist(err) {
			t.Errorf("size %d: the temporary file is left: %v", size, err)
		}
		for _, p := range []string{ours, theirs} {
			if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0xe1 1M 2M", "-c", "write -P 0x77 50M 9M", p).CombinedOutput(); err != nil {
				t.Fatalf("qemu-io on %s: %v: %s", filepath.Base(p), err, out)
			}
		}
		check(ours)
		if out, err := exec.Command("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", ours, theirs).CombinedOutput(); err != nil {
			t.Errorf("size %d: after the same writes the overlays differ: %v: %s", size, err, out)
		}
		// Unwritten, the overlay reads its backing file.
		if out, err := exec.Command("qemu-io", "-f", "qcow2", "-r", "-c", "read -P 0x5a 3M 1M", "-c", "read -P 0x3c 40M 1M", ours).CombinedOutput(); err != nil || strings.Contains(string(out), "Pattern verification failed") {
			t.Errorf("size %d: reading the backing file through the overlay: %v: %s", size, err, out)
		}
		_ = os.Remove(ours)
		_ = os.Remove(theirs)
	}
	for _, bad := range []struct {
		backing string
		size    int64
	}{{"base.qcow2", 0}, {"base.qcow2", 1000}, {"", 1 << 20}, {strings.Repeat("x", 1024), 1 << 20}, {"a\x00b", 1 << 20}} {
		if err := WriteOverlay(filepath.Join(dir, "bad.qcow2"), bad.backing, bad.size); err == nil {
			t.Errorf("overlay of %d bytes on %q: made; want it refused", bad.size, bad.backing)
		}
	}
}
