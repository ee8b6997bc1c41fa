package qcow2

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// The guest reader reads what qemu-img wrote: a raw disk with data, zeros
// and holes, converted to qcow2 plain and compressed (zlib, as
// distributions ship their cloud images), with small and default clusters,
// reads back byte for byte at the start, across cluster edges and at the
// end.
func TestGuestReadsWhatQemuImgWrote(t *testing.T) {
	requireQemuImg(t)
	dir := t.TempDir()
	const size = 4 << 20
	raw := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	// Data in the first 96 KiB (an MBR, a GPT, more), a zero stretch, data
	// at 1 MiB and the last sector; the rest a hole.
	for _, r := range [][2]int{{0, 96 << 10}, {1 << 20, 1<<20 + 70000}, {size - 512, size}} {
		for i := r[0]; i < r[1]; i++ {
			raw[i] = byte(rng.IntN(7)) // compressible, not zero everywhere
		}
	}
	for i := 8192; i < 16384; i++ {
		raw[i] = 0
	}
	rawPath := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(rawPath, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		args []string
	}{
		{"plain", nil},
		{"compressed", []string{"-c"}},
		{"compressed-4k-clusters", []string{"-c", "-o", "cluster_size=4096"}},
		{"v2", []string{"-o", "compat=0.10"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, c.name+".qcow2")
			runQemuImg(t, append(append([]string{"convert", "-f", "raw", "-O", "qcow2"}, c.args...), rawPath, path)...)
			g, err := OpenGuest(path)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = g.Close() }()
			if g.Size() != size {
				t.Fatalf("size %d, want %d", g.Size(), size)
			}
			for _, r := range [][2]int{{0, 1024}, {0, 96 << 10}, {4000, 70000}, {1<<20 - 10, 1<<20 + 80000}, {size - 1000, size}} {
				got := make([]byte, r[1]-r[0])
				if _, err := g.ReadAt(got, int64(r[0])); err != nil {
					t.Fatalf("read %d-%d: %v", r[0], r[1], err)
				}
				if !bytes.Equal(got, raw[r[0]:r[1]]) {
					t.Fatalf("bytes %d-%d differ from the raw disk", r[0], r[1])
				}
			}
			if n, err := g.ReadAt(make([]byte, 100), size-50); n != 50 || !errors.Is(err, io.EOF) {
				t.Fatalf("read past the end: %d, %v; want 50, EOF", n, err)
			}
		})
	}
}

// A file with a backing file is refused: its guest view is not its own.
func TestGuestRefusesAnOverlay(t *testing.T) {
	dir := t.TempDir()
	if err := WriteOverlay(filepath.Join(dir, "top.qcow2"), "base.qcow2", 1<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenGuest(filepath.Join(dir, "top.qcow2")); err == nil {
		t.Fatal("an overlay was opened for its guest view; want a refusal")
	}
}
