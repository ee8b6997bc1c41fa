// Package qcow2 reads the header of a qcow2 file and writes an empty
// overlay (QEMU's docs/interop/qcow2.txt). The agent reads headers when it
// installs a registered image (its virtual size; a self-contained file) and
// when it checks the disk chain of a pulled snapshot, and writes overlays
// for a fork's children and a snapshot's next disk generation: on the path
// of a fork, where running qemu-img once per file cost 7 ms alone and
// 15-35 ms on a busy host. Both are small, fixed layouts.
//
// The reader is strict: it accepts what the agent's own disks are
// (qcow2 v2 or v3, no encryption, no external data file, known feature
// bits and header extensions) and refuses anything else with a reason, so
// a hostile header can only be refused, never half understood. It reads
// the header cluster alone: no backing file is opened.
//
// The writer makes the layout qemu-img create makes for an empty overlay
// (v3, 64 KiB clusters, 16-bit refcounts): the header with the backing
// format extension and the backing name in cluster 0, the refcount table
// in cluster 1, its one refcount block in cluster 2, and the L1 table,
// all zero (nothing allocated: every read goes to the backing file), from
// cluster 3.
package qcow2

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

const (
	magic = 0x514649fb // "QFI\xfb"
	// Header extension types.
	extEnd           = 0x00000000
	extBackingFormat = 0xe2792aca
	extFeatureTable  = 0x6803f857
	extBitmaps       = 0x23852875
	extEncryption    = 0x0537be77
	extDataFile      = 0x44415441
	// Incompatible feature bits.
	incompatDirty       = 1 << 0
	incompatCorrupt     = 1 << 1
	incompatDataFile    = 1 << 2
	incompatCompression = 1 << 3
	incompatExtendedL2  = 1 << 4
	// The v2 header's length; a v3 header says its own (at least 104).
	v2HeaderLength = 72
	v3HeaderLength = 104
	// MaxBackingName is the longest backing file name QEMU accepts.
	MaxBackingName = 1023
)

// Layout of a new overlay (WriteOverlay).
const (
	overlayClusterBits  = 16
	overlayCluster      = 1 << overlayClusterBits
	overlayRefcountBits = 16
	overlayHeaderLength = 112 // v3 with the compression type byte, padded
)

// ErrNotQcow2 is the error of a file that does not start with the qcow2
// magic: not a qcow2 file at all, as opposed to one that is refused.
var ErrNotQcow2 = errors.New(`no qcow2 magic ("QFI\xfb") at its start`)

// Header is what the agent reads of a qcow2 file.
type Header struct {
	BackingFilename string // "" when the file has no backing file
	BackingFormat   string // "" when the header names none
	VirtualSize     int64
}

// ReadHeader reads the header of the qcow2 file at path.
func ReadHeader(path string) (Header, error) {
	f, err := os.Open(path)
	if err != nil {
		return Header{}, err
	}
	defer func() { _ = f.Close() }()
	// The header, its extensions and the backing name all lie in the first
	// cluster, which is at least 512 bytes and at most 2 MiB.
	buf := make([]byte, 2<<20)
	n, err := io.ReadFull(f, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return Header{}, fmt.Errorf("%s: read its header: %w", filepath.Base(path), err)
	}
	h, err := Parse(buf[:n])
	if err != nil {
		return Header{}, fmt.Errorf("%s is not a qcow2 image this agent accepts: %w", filepath.Base(path), err)
	}
	return h, nil
}

// Parse parses the start of a qcow2 file (its first cluster, or all of a
// shorter file).
func Parse(b []byte) (Header, error) {
	be := binary.BigEndian
	if len(b) < 4 || be.Uint32(b[0:]) != magic {
		return Header{}, ErrNotQcow2
	}
	if len(b) < v2HeaderLength {
		return Header{}, fmt.Errorf("%d bytes is too short for a qcow2 header", len(b))
	}
	version := be.Uint32(b[4:])
	backingOffset, backingSize := be.Uint64(b[8:]), be.Uint32(b[16:])
	clusterBits := be.Uint32(b[20:])
	size := be.Uint64(b[24:])
	if version != 2 && version != 3 {
		return Header{}, fmt.Errorf("qcow2 version %d (want 2 or 3)", version)
	}
	if clusterBits < 9 || clusterBits > 21 {
		return Header{}, fmt.Errorf("cluster bits %d (want 9 to 21)", clusterBits)
	}
	cluster := uint64(1) << clusterBits
	if size > 1<<62 {
		return Header{}, fmt.Errorf("virtual size %d is out of range", size)
	}
	if crypt := be.Uint32(b[32:]); crypt != 0 {
		return Header{}, fmt.Errorf("encrypted (method %d)", crypt)
	}
	headerLength := uint64(v2HeaderLength)
	if version == 3 {
		if len(b) < v3HeaderLength {
			return Header{}, fmt.Errorf("%d bytes is too short for a qcow2 v3 header", len(b))
		}
		incompat := be.Uint64(b[72:])
		headerLength = uint64(be.Uint32(b[100:]))
		switch {
		case incompat&incompatDataFile != 0:
			return Header{}, errors.New("it has an external data file")
		case incompat&incompatCorrupt != 0:
			return Header{}, errors.New("it is marked corrupt")
		case incompat&^(incompatDirty|incompatCompression|incompatExtendedL2) != 0:
			return Header{}, fmt.Errorf("unknown incompatible features %#x", incompat)
		case headerLength < v3HeaderLength || headerLength%8 != 0 || headerLength > cluster:
			return Header{}, fmt.Errorf("header length %d", headerLength)
		}
	}
	if headerLength > uint64(len(b)) {
		return Header{}, errors.New("the header is cut short")
	}
	h := Header{VirtualSize: int64(size)}
	// Header extensions, up to the end marker, inside the first cluster.
	end := min(cluster, uint64(len(b)))
	for off := headerLength; ; {
		if off+8 > end {
			return Header{}, errors.New("header extensions run past the first cluster")
		}
		typ, length := be.Uint32(b[off:]), uint64(be.Uint32(b[off+4:]))
		data := off + 8
		if typ == extEnd {
			break
		}
		if data+length > end {
			return Header{}, fmt.Errorf("header extension %#x runs past the first cluster", typ)
		}
		switch typ {
		case extBackingFormat:
			h.BackingFormat = string(b[data : data+length])
		case extFeatureTable, extBitmaps:
		case extDataFile:
			return Header{}, errors.New("it names an external data file")
		case extEncryption:
			return Header{}, errors.New("it has an encryption header")
		default:
			return Header{}, fmt.Errorf("unknown header extension %#x", typ)
		}
		off = data + (length+7)&^7
	}
	if backingOffset != 0 {
		switch {
		case backingSize == 0 || backingSize > MaxBackingName:
			return Header{}, fmt.Errorf("backing file name of %d bytes", backingSize)
		case backingOffset+uint64(backingSize) > end:
			return Header{}, errors.New("the backing file name lies past the first cluster")
		}
		name := b[backingOffset : backingOffset+uint64(backingSize)]
		if bytes.IndexByte(name, 0) >= 0 {
			return Header{}, errors.New("the backing file name holds a NUL byte")
		}
		h.BackingFilename = string(name)
	} else if h.BackingFormat != "" {
		return Header{}, errors.New("a backing format without a backing file")
	}
	return h, nil
}

// WriteOverlay creates path, an empty qcow2 overlay of size bytes on
// the qcow2 file backing (a name resolved from path's directory, as QEMU
// resolves it; the file need not exist yet), as qemu-img create -u -b
// backing -F qcow2 path size would. It is written to a temporary name and
// renamed into place, so a crash never leaves a half-made disk.
func WriteOverlay(path, backing string, size int64) error {
	switch {
	case size <= 0 || size%512 != 0:
		return fmt.Errorf("overlay %s: size %d is not a positive multiple of 512", filepath.Base(path), size)
	case backing == "" || len(backing) > MaxBackingName || strings.ContainsRune(backing, 0):
		return fmt.Errorf("overlay %s: backing file name %q", filepath.Base(path), backing)
	}
	be := binary.BigEndian
	const l2Bytes = overlayCluster * (overlayCluster / 8) // guest bytes one L2 table maps
	l1Entries := (uint64(size) + l2Bytes - 1) / l2Bytes
	l1Clusters := (l1Entries*8 + overlayCluster - 1) / overlayCluster
	clusters := 3 + l1Clusters
	if clusters > overlayCluster*8/overlayRefcountBits {
		return fmt.Errorf("overlay %s: %d bytes need more than one refcount block", filepath.Base(path), size)
	}
	const format = "qcow2"
	extLen := uint64(8 + (len(format)+7)&^7 + 8) // backing format, end
	backingOffset := overlayHeaderLength + extLen
	head := make([]byte, 3*overlayCluster)
	be.PutUint32(head[0:], magic)
	be.PutUint32(head[4:], 3)
	be.PutUint64(head[8:], backingOffset)
	be.PutUint32(head[16:], uint32(len(backing)))
	be.PutUint32(head[20:], overlayClusterBits)
	be.PutUint64(head[24:], uint64(size))
	be.PutUint32(head[36:], uint32(l1Entries))
	be.PutUint64(head[40:], 3*overlayCluster) // L1 table
	be.PutUint64(head[48:], overlayCluster)   // refcount table
	be.PutUint32(head[56:], 1)                // refcount table clusters
	be.PutUint32(head[96:], 4)                // refcount order: 16 bits
	be.PutUint32(head[100:], overlayHeaderLength)
	ext := head[overlayHeaderLength:]
	be.PutUint32(ext[0:], extBackingFormat)
	be.PutUint32(ext[4:], uint32(len(format)))
	copy(ext[8:], format)
	copy(head[backingOffset:], backing)
	be.PutUint64(head[overlayCluster:], 2*overlayCluster) // the refcount block
	for c := range clusters {
		be.PutUint16(head[2*overlayCluster+2*c:], 1)
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o640)
	if err != nil {
		return fmt.Errorf("overlay %s: %w", filepath.Base(path), err)
	}
	_, err = f.Write(head)
	if err == nil {
		// The L1 table, all zero, ends the file, as qemu-img leaves it.
		err = f.Truncate(int64(3*overlayCluster + l1Entries*8))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("overlay %s: %w", filepath.Base(path), err)
	}
	return nil
}
