package qcow2

import (
	"bytes"
	"compress/flate"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Guest reads what a guest sees at the start of a self-contained qcow2
// file: the agent reads a disk image's first sectors (its partition table
// and boot code) to tell the firmware it needs (package image). It follows
// the L1 and L2 tables (docs/interop/qcow2.txt) for standard, all-zero,
// unallocated and zlib-compressed clusters; a file with a backing file,
// extended L2 entries or zstd compression is refused with a reason, as the
// header reader refuses what it does not know.
type Guest struct {
	f           *os.File
	name        string
	clusterBits uint32
	l1          []uint64 // the L1 table, read at Open
	size        int64
}

// guestL1Max bounds the L1 entries read at Open (each maps cluster²/8
// bytes: 32 GiB for 64 KiB clusters); the agent reads only the start.
const guestL1Max = 4096

// OpenGuest opens the qcow2 file at path for reading its guest view.
func OpenGuest(path string) (*Guest, error) {
	h, err := ReadHeader(path)
	if err != nil {
		return nil, err
	}
	name := filepath.Base(path)
	if h.BackingFilename != "" {
		return nil, fmt.Errorf("%s has a backing file: only a self-contained file is read", name)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	g := &Guest{f: f, name: name, size: h.VirtualSize}
	if err := g.readTables(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return g, nil
}

func (g *Guest) readTables() error {
	be := binary.BigEndian
	b := make([]byte, v3HeaderLength+8)
	n, err := g.f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	b = b[:n]
	g.clusterBits = be.Uint32(b[20:])
	l1Size, l1Off := be.Uint32(b[36:]), be.Uint64(b[40:])
	if be.Uint32(b[4:]) == 3 {
		incompat := be.Uint64(b[72:])
		if incompat&incompatExtendedL2 != 0 {
			return errors.New("extended L2 entries are not read")
		}
		if incompat&incompatCompression != 0 && be.Uint32(b[100:]) > v3HeaderLength && len(b) > v3HeaderLength && b[v3HeaderLength] != 0 {
			return fmt.Errorf("compression type %d is not read (zlib only)", b[v3HeaderLength])
		}
	}
	l1Size = min(l1Size, guestL1Max)
	raw := make([]byte, 8*int(l1Size))
	if _, err := g.f.ReadAt(raw, int64(l1Off)); err != nil {
		return fmt.Errorf("read the L1 table: %w", err)
	}
	g.l1 = make([]uint64, l1Size)
	for i := range g.l1 {
		g.l1[i] = be.Uint64(raw[8*i:])
	}
	return nil
}

// Close closes the file.
func (g *Guest) Close() error { return g.f.Close() }

// Size is the guest's disk size in bytes.
func (g *Guest) Size() int64 { return g.size }

const (
	l2OffsetMask      = 0x00fffffffffffe00 // bits 9-55 of an L1 or a standard L2 entry
	l2Compressed      = 1 << 62
	l2ZeroCluster     = 1 << 0
	compressedSectors = 512
)

// ReadAt reads the guest's bytes at off, one cluster at a time.
func (g *Guest) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("negative offset")
	}
	cluster := int64(1) << g.clusterBits
	n := 0
	for n < len(p) {
		pos := off + int64(n)
		if pos >= g.size {
			return n, io.EOF
		}
		data, err := g.cluster(pos / cluster)
		if err != nil {
			return n, fmt.Errorf("%s: guest offset %d: %w", g.name, pos, err)
		}
		in := pos % cluster
		c := copy(p[n:], data[in:min(int64(len(data)), g.size-(pos-in))])
		n += c
	}
	return n, nil
}

// cluster returns the guest's cluster i.
func (g *Guest) cluster(i int64) ([]byte, error) {
	be := binary.BigEndian
	size := int64(1) << g.clusterBits
	perL2 := size / 8
	l1i := i / perL2
	if l1i >= int64(len(g.l1)) {
		return nil, errors.New("beyond the L1 entries read")
	}
	l2Off := int64(g.l1[l1i] & l2OffsetMask)
	if l2Off == 0 {
		return make([]byte, size), nil // unallocated: zeros, without a backing file
	}
	var e [8]byte
	if _, err := g.f.ReadAt(e[:], l2Off+8*(i%perL2)); err != nil {
		return nil, fmt.Errorf("read an L2 entry: %w", err)
	}
	entry := be.Uint64(e[:])
	if entry&l2Compressed != 0 {
		return g.compressed(entry &^ (3 << 62))
	}
	host := int64(entry & l2OffsetMask)
	if entry&l2ZeroCluster != 0 || host == 0 {
		return make([]byte, size), nil
	}
	out := make([]byte, size)
	if _, err := g.f.ReadAt(out, host); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read a cluster: %w", err)
	}
	return out, nil
}

// compressed inflates a compressed cluster of descriptor d: bits 0 to x-1
// the host offset, x to 61 the sectors after the first, x = 62 - (cluster
// bits - 8), raw deflate data as QEMU writes it.
func (g *Guest) compressed(d uint64) ([]byte, error) {
	x := 62 - (g.clusterBits - 8)
	off := int64(d & (1<<x - 1))
	sectors := int64((d>>x)&(1<<(g.clusterBits-8)-1)) + 1
	csize := sectors*compressedSectors - off%compressedSectors
	buf := make([]byte, csize)
	n, err := g.f.ReadAt(buf, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read a compressed cluster: %w", err)
	}
	out := make([]byte, int64(1)<<g.clusterBits)
	if _, err := io.ReadFull(flate.NewReader(bytes.NewReader(buf[:n])), out); err != nil {
		return nil, fmt.Errorf("inflate a compressed cluster: %w", err)
	}
	return out, nil
}
