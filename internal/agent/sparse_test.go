package agent

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/zeebo/blake3"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
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

	digest, err := SparseDigest(src, size, NewRAMHash)
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
	// The digest is the BLAKE3 of the stream (sparse.go).
	if b3 := blake3.Sum256(stream.Bytes()); digest != hex.EncodeToString(b3[:]) {
		t.Fatalf("digest %s is not the blake3 of the stream, %x", digest, b3)
	}
	nonZero := map[int64]bool{}
	for _, p := range pages {
		nonZero[p] = true
	}
	if max := int64(len(nonZero))*sparsePage + int64(len(nonZero)+1)*sparseHead; int64(stream.Len()) > max {
		t.Fatalf("stream of %d bytes for %d non-zero pages: zero pages were sent", stream.Len(), len(nonZero))
	}
	got := create(t, filepath.Join(dir, "pulled"))
	d, n, err := ReadSparse(got, bytes.NewReader(stream.Bytes()), size, NewRAMHash)
	if err != nil || d != digest || n != int64(stream.Len()) {
		t.Fatalf("ReadSparse = %s, %d, %v; want %s, %d", d, n, err, digest, stream.Len())
	}
	for _, f := range []string{"copy", "pulled"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil || !bytes.Equal(b, want) {
			t.Fatalf("%s differs from the source (%d bytes, %v)", f, len(b), err)
		}
		// The same content gives the same digest on any agent.
		if d, err := SparseDigest(open(t, filepath.Join(dir, f)), size, NewRAMHash); err != nil || d != digest {
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
	if _, _, err := ReadSparse(out, &stream, 2*sparseBlock, NewRAMHash); err != nil {
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
			_, _, err := ReadSparse(out, bytes.NewReader(bytes.Join(c.stream, nil)), size, NewRAMHash)
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
		d, n, err := ReadSparse(out, bytes.NewReader(stream), size, NewRAMHash)
		if err != nil {
			return
		}
		if out.size != size || n > int64(len(stream)) {
			t.Fatalf("accepted stream: size %d, read %d of %d bytes", out.size, n, len(stream))
		}
		if b3 := blake3.Sum256(stream[:n]); d != hex.EncodeToString(b3[:]) {
			t.Fatalf("digest %s is not the blake3 of the stream read", d)
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

// TestPipeHashIsItsHash feeds a pipeHash writes of many sizes, across its
// buffer boundaries, and compares with its hash run in line (sha256 and
// blake3).
func TestPipeHashIsItsHash(t *testing.T) {
	data := make([]byte, 5*sparseBlock+12345)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	b3 := blake3.Sum256(data)
	for _, c := range []struct {
		newHash func() hash.Hash
		want    string
	}{{sha256.New, digestOf(sha256Of(data))}, {NewRAMHash, hex.EncodeToString(b3[:])}} {
		for _, step := range []int{1, sparseHead, 4093, sparsePage, sparseBlock - 1, sparseBlock, 3*sparseBlock + 5, len(data)} {
			p := newPipeHash(c.newHash())
			for off := 0; off < len(data); off += step {
				if _, err := p.Write(data[off:min(off+step, len(data))]); err != nil {
					t.Fatal(err)
				}
			}
			if got := p.sum(); got != c.want {
				t.Fatalf("writes of %d bytes: digest %s, want %s", step, got, c.want)
			}
		}
	}
	// stop without sum, and twice, ends it without blocking.
	p := newPipeHash(sha256.New())
	_, _ = p.Write(data)
	p.stop()
	p.stop()
}

// A RAM image is recorded with the BLAKE3 of its sparse stream; one
// recorded before that (a snapshot on disk, or an agent of an earlier
// version) has the stream's SHA-256 and is checked with it. Metadata with
// no digest, both, or a BLAKE3 on a file that is not a RAM image is
// refused.
func TestRAMDigestAlgorithms(t *testing.T) {
	dir, err := os.MkdirTemp(t.TempDir(), "snap")
	if err != nil {
		t.Fatal(err)
	}
	const size = 4 * sparseBlock
	ramImage(t, filepath.Join(dir, "memory.ram"), size, []int64{0, 5, 300})
	if err := os.WriteFile(filepath.Join(dir, "memory.state"), []byte("state"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if err := WriteSparse(&stream, open(t, filepath.Join(dir, "memory.ram")), size); err != nil {
		t.Fatal(err)
	}
	b3, s2 := blake3.Sum256(stream.Bytes()), sha256.Sum256(stream.Bytes())
	state := sha256.Sum256([]byte("state"))
	ram := agentapi.SnapshotFile{Name: "memory.ram", Kind: agentapi.SnapshotFileRAM}
	mem := agentapi.SnapshotFile{Name: "memory.state", Kind: agentapi.SnapshotFileMemory, SizeBytes: 5, SHA256: hex.EncodeToString(state[:])}

	// A new record: describeFiles takes the BLAKE3.
	files, err := (&Agent{}).describeFiles(dir, SnapshotFiles{Memory: "memory.state", RAM: "memory.ram"})
	if err != nil {
		t.Fatal(err)
	}
	if files[1].BLAKE3 != hex.EncodeToString(b3[:]) || files[1].SHA256 != "" || files[0].SHA256 != mem.SHA256 {
		t.Fatalf("described %+v; want the ram file's blake3 %x and the state's sha256", files, b3)
	}
	rec := snapshotRecord{Version: snapshotVersion, ID: "s", Image: "busybox", VCPUs: 1, MemoryMiB: 64, Files: files}
	if err := rec.validate("s"); err != nil {
		t.Fatalf("new record: %v", err)
	}

	legacy := ram
	legacy.SizeBytes, legacy.SHA256 = size, hex.EncodeToString(s2[:])
	if newHash, want := ramHash(legacy); want != legacy.SHA256 || newHash().Size() != sha256.Size {
		t.Fatalf("a legacy ram file is checked against %q", want)
	}
	if _, sum, err := digestFile(filepath.Join(dir, "memory.ram"), legacy, ""); err != nil || sum != legacy.SHA256 {
		t.Fatalf("digest of a legacy ram file: %s, %v; want its sha256 %s", sum, err, legacy.SHA256)
	}
	rec.Files = []agentapi.SnapshotFile{mem, legacy}
	if err := rec.validate("s"); err != nil {
		t.Fatalf("legacy record: %v", err)
	}
	// An unsynced legacy snapshot found at start is checked with SHA-256.
	rec.Unsynced = true
	if err := (&Agent{cfg: Config{NoSync: true}, log: slog.New(slog.DiscardHandler)}).recoverUnsynced(dir, &rec); err != nil || rec.Unsynced {
		t.Fatalf("recover a legacy snapshot: %v (unsynced %v)", err, rec.Unsynced)
	}

	both := legacy
	both.BLAKE3 = hex.EncodeToString(b3[:])
	onDisk := mem
	onDisk.BLAKE3, onDisk.SHA256 = onDisk.SHA256, ""
	none := ram
	for name, f := range map[string]agentapi.SnapshotFile{"both digests": both, "blake3 on a state file": onDisk, "no digest": none} {
		files := []agentapi.SnapshotFile{mem, f}
		if f.Kind == agentapi.SnapshotFileMemory {
			files = []agentapi.SnapshotFile{f}
		}
		bad := snapshotRecord{Version: snapshotVersion, ID: "s", Image: "busybox", VCPUs: 1, MemoryMiB: 64, Files: files}
		if err := bad.validate("s"); err == nil || !strings.Contains(err.Error(), "digest") {
			t.Errorf("%s: validate = %v; want it refused for its digest", name, err)
		}
	}
}

// referenceStream is the sparse stream by its definition (sparse.go): the
// maximal runs of non-zero pages inside each aligned block of content.
func referenceStream(content []byte) []byte {
	var out []byte
	var head [sparseHead]byte
	size := int64(len(content))
	for b := int64(0); b < size; b += sparseBlock {
		block := content[b:min(b+sparseBlock, size)]
		_ = emitRuns(b, block, func(off int64, data []byte) error {
			putRecordHead(&head, off, len(data))
			out = append(append(out, head[:]...), data...)
			return nil
		})
	}
	putRecordHead(&head, size, 0)
	return append(out, head[:]...)
}

// The stream read from a mapping, data extent by data extent, is the one
// its definition gives for the file's content, whatever the extents; and a
// copy out of a memfd reads none of its holes (reading one through a
// mapping would allocate it: the source VM would grow).
func TestSparseStreamIsItsDefinitionAndReadsNoHoles(t *testing.T) {
	dir := t.TempDir()
	const size = 9*sparseBlock + 5*sparsePage
	pages := []int64{0, 3, 4, 255, 256, 511, 1024, 1025, 2047, size/sparsePage - 1}
	for range 200 {
		pages = append(pages, rand.Int64N(size/sparsePage))
	}
	want := ramImage(t, filepath.Join(dir, "src"), size, pages)
	var stream bytes.Buffer
	if err := WriteSparse(&stream, open(t, filepath.Join(dir, "src")), size); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(stream.Bytes(), referenceStream(want)) {
		t.Fatalf("stream of %d bytes differs from the definition's %d", stream.Len(), len(referenceStream(want)))
	}

	fd, err := unix.MemfdCreate("ram", 0)
	if err != nil {
		t.Skipf("no memfd here: %v", err)
	}
	mem := os.NewFile(uintptr(fd), "memfd:ram")
	t.Cleanup(func() { _ = mem.Close() })
	if err := mem.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, p := range pages {
		if _, err := mem.WriteAt(want[p*sparsePage:(p+1)*sparsePage], p*sparsePage); err != nil {
			t.Fatal(err)
		}
	}
	blocks := func() int64 {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks
	}
	before := blocks()
	cp := create(t, filepath.Join(dir, "copy"))
	d, err := CopySparse(cp, mem, size)
	if err != nil {
		t.Fatal(err)
	}
	if after := blocks(); after != before {
		t.Errorf("the copy allocated %d of the memfd's holes (blocks %d -> %d)", (after-before)*512/sparsePage, before, after)
	}
	if b3 := blake3.Sum256(stream.Bytes()); d != hex.EncodeToString(b3[:]) {
		t.Errorf("copy's digest %s is not the stream's blake3 %x", d, b3)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "copy")); err != nil || !bytes.Equal(b, want) {
		t.Errorf("the copy differs from the memfd's content (%d bytes, %v)", len(b), err)
	}
}
