package agent

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ramImage writes a file of size bytes with non-zero pages at the given
// page numbers (each filled with its number) and returns its content.
func ramImage(t *testing.T, path string, size int64, pages []int64) []byte {
	t.Helper()
	want := make([]byte, size)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	for _, p := range pages {
		page := want[p*sparsePage : min((p+1)*sparsePage, size)]
		for i := range page {
			page[i] = byte(p%251 + 1)
		}
		if _, err := f.WriteAt(page, p*sparsePage); err != nil {
			t.Fatal(err)
		}
	}
	// A written page of zeros is data to the filesystem, not a hole: the
	// stream must still leave it out.
	if _, err := f.WriteAt(make([]byte, sparsePage), 3*sparseBlock); err != nil {
		t.Fatal(err)
	}
	// That page may also be one of pages: it is zero now.
	clear(want[3*sparseBlock : 3*sparseBlock+sparsePage])
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return want
}

func open(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func create(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// TestSparseRoundTrip: the copy, the stream and the digest agree, carry only
// the non-zero pages, and rebuild the same content, for images whose runs
// cross block borders and whose size is not a whole number of blocks.
func TestSparseRoundTrip(t *testing.T) {
	dir := t.TempDir()
	const size = 5*sparseBlock + 3*sparsePage
	pages := []int64{0, 1, 2, 255, 256, 257, 700, 1024 + 5, size/sparsePage - 1}
	for range 50 {
		pages = append(pages, rand.Int64N(size/sparsePage))
	}
	want := ramImage(t, filepath.Join(dir, "src"), size, pages)
	src := open(t, filepath.Join(dir, "src"))

	digest, err := SparseDigest(src, size)
	if err != nil {
		t.Fatal(err)
	}
	cp := create(t, filepath.Join(dir, "copy"))
	if d, err := CopySparse(cp, src, size); err != nil || d != digest {
		t.Fatalf("CopySparse = %s, %v; SparseDigest = %s", d, err, digest)
	}
	var stream bytes.Buffer
	if err := WriteSparse(&stream, src, size); err != nil {
		t.Fatal(err)
	}
	nonZero := map[int64]bool{}
	for _, p := range pages {
		nonZero[p] = true
	}
	if max := int64(len(nonZero))*sparsePage + int64(len(nonZero)+1)*sparseHead; int64(stream.Len()) > max {
		t.Fatalf("stream of %d bytes for %d non-zero pages: zero pages were sent", stream.Len(), len(nonZero))
	}
	got := create(t, filepath.Join(dir, "pulled"))
	d, n, err := ReadSparse(got, bytes.NewReader(stream.Bytes()), size)
	if err != nil || d != digest || n != int64(stream.Len()) {
		t.Fatalf("ReadSparse = %s, %d, %v; want %s, %d", d, n, err, digest, stream.Len())
	}
	for _, f := range []string{"copy", "pulled"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil || !bytes.Equal(b, want) {
			t.Fatalf("%s differs from the source (%d bytes, %v)", f, len(b), err)
		}
		// The same content gives the same digest on any agent.
		if d, err := SparseDigest(open(t, filepath.Join(dir, f)), size); err != nil || d != digest {
			t.Fatalf("digest of %s = %s, %v; want %s", f, d, err, digest)
		}
	}
}

func TestSparseEmptyImage(t *testing.T) {
	dir := t.TempDir()
	f := create(t, filepath.Join(dir, "empty"))
	if err := f.Truncate(2 * sparseBlock); err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if err := WriteSparse(&stream, f, 2*sparseBlock); err != nil || stream.Len() != sparseHead {
		t.Fatalf("stream of an empty image: %d bytes, %v; want only the end record", stream.Len(), err)
	}
	out := create(t, filepath.Join(dir, "out"))
	if _, _, err := ReadSparse(out, &stream, 2*sparseBlock); err != nil {
		t.Fatal(err)
	}
	if fi, _ := out.Stat(); fi.Size() != 2*sparseBlock {
		t.Fatalf("size %d", fi.Size())
	}
}

func record(off, n int64, data byte) []byte {
	b := make([]byte, sparseHead+n)
	binary.BigEndian.PutUint64(b, uint64(off))
	binary.BigEndian.PutUint64(b[8:], uint64(n))
	for i := range n {
		b[sparseHead+i] = data
	}
	return b
}

// TestReadSparseRejects: a stream from another agent is input; every
// broken rule is an error, never a silently different file.
func TestReadSparseRejects(t *testing.T) {
	const size = 4 * sparseBlock
	cases := map[string]struct {
		stream [][]byte
		want   string
	}{
		"empty":           {nil, "record head"},
		"no end":          {[][]byte{record(0, sparsePage, 1)}, "record head"},
		"short data":      {[][]byte{record(0, sparsePage, 1)[:100]}, "unexpected EOF"},
		"end at a size":   {[][]byte{record(size+sparsePage, 0, 0)}, "ends at size"},
		"unaligned":       {[][]byte{record(100, sparsePage, 1)}, "aligned"},
		"overlap":         {[][]byte{record(2*sparsePage, sparsePage, 1), record(sparsePage, 2*sparsePage, 1)}, "overlaps"},
		"outside":         {[][]byte{record(size, sparsePage, 1)}, "outside"},
		"larger than all": {[][]byte{record(0, 0, 0)[:8], {0x40, 0, 0, 0, 0, 0, 0, 0}}, "outside"},
		"part of a page":  {[][]byte{record(0, 100, 1)}, "whole pages"},
		"negative length": {[][]byte{record(0, 0, 0)[:8], {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0, 0}}, "outside"},
		"negative offset": {[][]byte{{0x80, 0, 0, 0, 0, 0, 0, 0}, record(0, sparsePage, 0)[8:16]}, "outside"},
		"after the end":   {[][]byte{record(size, 0, 0), {0}}, "after its end"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			out := create(t, filepath.Join(t.TempDir(), "out"))
			_, _, err := ReadSparse(out, bytes.NewReader(bytes.Join(c.stream, nil)), size)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %q", err, c.want)
			}
		})
	}
}

// FuzzReadSparse: whatever a peer sends, ReadSparse neither panics nor
// writes outside the file, and what it accepts re-encodes to its digest.
func FuzzReadSparse(f *testing.F) {
	const size = 16 * sparsePage // the rules do not depend on the size
	f.Add(bytes.Join([][]byte{record(0, sparsePage, 7), record(3*sparsePage, sparsePage, 9), record(size, 0, 0)}, nil))
	f.Add(record(size, 0, 0))
	f.Add(record(0, sparsePage, 1))
	f.Fuzz(func(t *testing.T, stream []byte) {
		out := &memTarget{t: t, b: make([]byte, size)}
		d, n, err := ReadSparse(out, bytes.NewReader(stream), size)
		if err != nil {
			return
		}
		if out.size != size || n > int64(len(stream)) {
			t.Fatalf("accepted stream: size %d, read %d of %d bytes", out.size, n, len(stream))
		}
		if d != digestOf(sha256Of(stream[:n])) {
			t.Fatalf("digest %s is not the sha256 of the stream read", d)
		}
	})
}

// memTarget is a SparseTarget in memory of a fixed size that fails the test
// on any write outside it.
type memTarget struct {
	t    *testing.T
	b    []byte
	size int64
}

func (m *memTarget) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		m.t.Fatalf("write of %d bytes at %d outside the %d-byte file", len(p), off, len(m.b))
	}
	return copy(m.b[off:], p), nil
}

func (m *memTarget) Truncate(size int64) error {
	m.size = size
	return nil
}

func sha256Of(b []byte) hash.Hash {
	h := sha256.New()
	h.Write(b)
	return h
}

// TestPipeHashIsSHA256 feeds a pipeHash writes of many sizes, across its
// buffer boundaries, and compares with crypto/sha256.
func TestPipeHashIsSHA256(t *testing.T) {
	data := make([]byte, 5*sparseBlock+12345)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	for _, step := range []int{1, sparseHead, 4093, sparsePage, sparseBlock - 1, sparseBlock, 3*sparseBlock + 5, len(data)} {
		p := newPipeHash()
		for off := 0; off < len(data); off += step {
			if _, err := p.Write(data[off:min(off+step, len(data))]); err != nil {
				t.Fatal(err)
			}
		}
		if got, want := p.sum(), digestOf(sha256Of(data)); got != want {
			t.Fatalf("writes of %d bytes: digest %s, want %s", step, got, want)
		}
	}
	// stop without sum, and twice, ends it without blocking.
	p := newPipeHash()
	_, _ = p.Write(data)
	p.stop()
	p.stop()
}
