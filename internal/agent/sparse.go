package agent

// The sparse form of a snapshot's RAM image (kind agentapi.SnapshotFileRAM).
//
// A guest touches a fraction of its RAM: a 256 MiB busybox guest leaves
// about two thirds of it zero. Its RAM image is therefore kept as a sparse
// file, and moved and checksummed in a form that carries only the non-zero
// pages:
//
//	record := offset uint64 (big endian) | length uint64 | length bytes
//	stream := record* end
//	end    := size uint64 | 0 uint64
//
// The records are the maximal runs of non-zero 4 KiB pages inside each
// aligned 1 MiB block of the file, in order. That makes the stream a
// function of the file's content alone (not of the filesystem's extents),
// so every agent that holds the image serves the same bytes, and the
// snapshot metadata's digest of such a file is the digest of its stream.
//
// That digest is BLAKE3 (SnapshotFile.BLAKE3), not the SHA-256 of the other
// files: the stream is tens to hundreds of MiB on the path of every fork,
// hashed as the snapshot copies it out of the paused guest and again as a
// peer receives it, and BLAKE3 hashes it 2.3 times as fast here (4.0
// against 1.76 GB/s on one core with SHA-NI). A RAM image of a snapshot
// taken before that has a SHA-256 and is checked with it (ramHash).

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"

	"github.com/zeebo/blake3"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	sparsePage  = 4 << 10
	sparseBlock = 1 << 20
	sparseHead  = 16
)

var zeroPage = make([]byte, sparsePage)

// scanSparse calls emit with each run of non-zero pages of the first size
// bytes of f, in the order of the stream. Holes are skipped without reading
// them (SEEK_DATA), so a mostly empty image costs what its data costs. The
// data comes from a read-only mapping of f (no copy; stable is true), valid
// until done is called; without one (a file that cannot be mapped) it is
// read into a buffer and valid only during the call. done must be called
// once scanSparse returned.
func scanSparse(f *os.File, size int64, emit func(off int64, data []byte, stable bool) error) (done func(), err error) {
	done = func() {}
	if size <= 0 {
		return done, nil
	}
	mem, merr := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	var read func(lo, hi int64) ([]byte, error)
	stable := merr == nil
	if stable {
		done = func() { _ = unix.Munmap(mem) }
		read = func(lo, hi int64) ([]byte, error) { return mem[lo:hi], nil }
	} else {
		buf := make([]byte, sparseBlock)
		read = func(lo, hi int64) ([]byte, error) {
			chunk := buf[:hi-lo]
			_, err := f.ReadAt(chunk, lo)
			return chunk, err
		}
	}
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return done, nil // only a hole is left
		}
		if err != nil {
			return done, fmt.Errorf("find data in %s: %w", f.Name(), err)
		}
		if data >= size {
			return done, nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return done, fmt.Errorf("find a hole in %s: %w", f.Name(), err)
		}
		hole = min(hole, size)
		// The data from page to page, cut at each aligned block: the hole
		// around it is zero and ends a run anyway, and nothing reads it (a
		// mapping of a memfd would allocate the pages it reads).
		for lo := data &^ (sparsePage - 1); lo < hole; {
			hi := min((lo&^(sparseBlock-1))+sparseBlock, (hole+sparsePage-1)&^(sparsePage-1), size)
			chunk, err := read(lo, hi)
			if err != nil {
				return done, fmt.Errorf("read %s at %d: %w", f.Name(), lo, err)
			}
			if err := emitRuns(lo, chunk, func(off int64, data []byte) error { return emit(off, data, stable) }); err != nil {
				return done, err
			}
			lo = hi
		}
		off = (hole + sparsePage - 1) &^ (sparsePage - 1)
	}
	return done, nil
}

// emitRuns emits the maximal runs of non-zero pages of one block.
func emitRuns(base int64, block []byte, emit func(off int64, data []byte) error) error {
	start := -1
	for p := 0; p < len(block); p += sparsePage {
		page := block[p:min(p+sparsePage, len(block))]
		zero := bytes.Equal(page, zeroPage[:len(page)])
		switch {
		case !zero && start < 0:
			start = p
		case zero && start >= 0:
			if err := emit(base+int64(start), block[start:p]); err != nil {
				return err
			}
			start = -1
		}
	}
	if start >= 0 {
		return emit(base+int64(start), block[start:])
	}
	return nil
}

func putRecordHead(h *[sparseHead]byte, off int64, n int) {
	binary.BigEndian.PutUint64(h[:8], uint64(off))
	binary.BigEndian.PutUint64(h[8:], uint64(n))
}

// WriteSparse writes the sparse stream of the first size bytes of f to w.
func WriteSparse(w io.Writer, f *os.File, size int64) error {
	var head [sparseHead]byte
	done, err := scanSparse(f, size, func(off int64, data []byte, _ bool) error {
		putRecordHead(&head, off, len(data))
		if _, err := w.Write(head[:]); err != nil {
			return err
		}
		_, err := w.Write(data)
		return err
	})
	done()
	if err != nil {
		return err
	}
	putRecordHead(&head, size, 0)
	_, err = w.Write(head[:])
	return err
}

// NewRAMHash is the hash of the sparse stream of a new RAM image.
func NewRAMHash() hash.Hash { return blake3.New() }

// ramHash is how the digest of snapshot file f is checked, and the digest
// its metadata records: the sparse stream's BLAKE3 for a RAM image (its
// SHA-256 for one recorded before BLAKE3), the file's SHA-256 otherwise.
func ramHash(f agentapi.SnapshotFile) (newHash func() hash.Hash, want string) {
	if usesBLAKE3(f) {
		return NewRAMHash, f.BLAKE3
	}
	return sha256.New, f.SHA256
}

func usesBLAKE3(f agentapi.SnapshotFile) bool {
	return f.Kind == agentapi.SnapshotFileRAM && (f.BLAKE3 != "" || f.SHA256 == "")
}

// digestName names the digest ramHash takes of f, for messages.
func digestName(f agentapi.SnapshotFile) string {
	if usesBLAKE3(f) {
		return "blake3"
	}
	return "sha256"
}

// setDigest records sum, taken as ramHash says, in f.
func setDigest(f *agentapi.SnapshotFile, sum string) {
	if usesBLAKE3(*f) {
		f.BLAKE3 = sum
		return
	}
	f.SHA256 = sum
}

// SparseDigest is the hex digest (newHash) of the sparse stream of f's
// first size bytes: what snapshot metadata lists for a RAM image.
func SparseDigest(f *os.File, size int64, newHash func() hash.Hash) (string, error) {
	h := newHash()
	if err := WriteSparse(h, f, size); err != nil {
		return "", err
	}
	return digestOf(h), nil
}

// CopySparse copies the first size bytes of src into dst (an empty file),
// writing only the non-zero pages, and returns the digest of the stream
// (NewRAMHash), as SparseDigest of dst would.
func CopySparse(dst, src *os.File, size int64) (string, error) {
	h := newPipeHash(NewRAMHash())
	var head [sparseHead]byte
	// Data from src's mapping is hashed straight from it, which the
	// hashing goroutine reads until h ends: done (the unmapping) comes after.
	done, err := scanSparse(src, size, func(off int64, data []byte, stable bool) error {
		putRecordHead(&head, off, len(data))
		h.add(head[:])
		if stable {
			h.addShared(data)
		} else {
			h.add(data)
		}
		_, err := dst.WriteAt(data, off)
		return err
	})
	defer done()
	defer h.stop()
	if err != nil {
		return "", fmt.Errorf("copy %s to %s: %w", src.Name(), dst.Name(), err)
	}
	putRecordHead(&head, size, 0)
	h.add(head[:])
	if err := dst.Truncate(size); err != nil {
		return "", err
	}
	return h.sum(), nil
}

// SparseTarget is what ReadSparse writes into: an *os.File.
type SparseTarget interface {
	io.WriterAt
	Truncate(size int64) error
}

// ReadSparse writes the sparse stream r into dst (an empty file) and checks
// it on the way: records in order, inside size, each whole pages (the last
// may end at size), then the end record of size, and nothing after it. It
// returns the stream's digest (newHash) and how many bytes of the stream it
// read. A stream that breaks any rule is an error, and the caller discards
// dst.
func ReadSparse(dst SparseTarget, r io.Reader, size int64, newHash func() hash.Hash) (string, int64, error) {
	h := newPipeHash(newHash())
	defer h.stop()
	cr := &countingReader{r: io.TeeReader(r, h)}
	buf := make([]byte, max(0, min(size, sparseBlock)))
	var head [sparseHead]byte
	next := int64(0) // the first offset the next record may start at
	for {
		if _, err := io.ReadFull(cr, head[:]); err != nil {
			return "", cr.n, fmt.Errorf("sparse stream: record head at byte %d: %w", cr.n, noEOF(err))
		}
		off, n := int64(binary.BigEndian.Uint64(head[:8])), int64(binary.BigEndian.Uint64(head[8:]))
		if n == 0 {
			if off != size {
				return "", cr.n, fmt.Errorf("sparse stream: ends at size %d, want %d", off, size)
			}
			if m, _ := io.ReadFull(r, head[:1]); m > 0 {
				return "", cr.n, errors.New("sparse stream: data after its end record")
			}
			if err := dst.Truncate(size); err != nil {
				return "", cr.n, err
			}
			return h.sum(), cr.n, nil
		}
		switch {
		case n < 0 || off < 0:
			// Lengths and offsets above 2^63 read as negative.
			return "", cr.n, fmt.Errorf("sparse stream: record of %d bytes at %d is outside the %d bytes of the file", uint64(n), uint64(off), size)
		case off < next || off%sparsePage != 0:
			return "", cr.n, fmt.Errorf("sparse stream: record at %d overlaps or is not page aligned", off)
		case off > size || n > size-off || n > sparseBlock:
			return "", cr.n, fmt.Errorf("sparse stream: record of %d bytes at %d is outside the %d bytes of the file", n, off, size)
		case n%sparsePage != 0 && off+n != size:
			return "", cr.n, fmt.Errorf("sparse stream: record of %d bytes at %d is not whole pages", n, off)
		}
		for left := n; left > 0; {
			chunk := buf[:min(left, int64(len(buf)))]
			if _, err := io.ReadFull(cr, chunk); err != nil {
				return "", cr.n, fmt.Errorf("sparse stream: record at %d: %w", off, noEOF(err))
			}
			if _, err := dst.WriteAt(chunk, off+n-left); err != nil {
				return "", cr.n, err
			}
			left -= int64(len(chunk))
		}
		next = off + n
	}
}

func digestOf(h hash.Hash) string { return hex.EncodeToString(h.Sum(nil)) }

// noEOF turns a clean EOF inside a stream into an unexpected one.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
