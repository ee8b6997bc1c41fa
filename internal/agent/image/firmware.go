package image

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

// Firmware an image boots with (Manifest.Firmware, a registered image's
// firmware): SeaBIOS, or UEFI (OVMF).
const (
	FirmwareBIOS = "bios"
	FirmwareUEFI = "uefi"
)

// CheckFirmware accepts "" (bios), bios and uefi.
func CheckFirmware(f string) error {
	switch f {
	case "", FirmwareBIOS, FirmwareUEFI:
		return nil
	}
	return fmt.Errorf("firmware %q: want bios or uefi", f)
}

// BootShape is what a disk's first sectors say about the firmware that can
// boot it: BIOS runs the boot code of sector 0 (the MBR), UEFI loads a
// bootloader from an EFI system partition.
type BootShape struct {
	// BIOSBootCode: sector 0 ends with the 0x55AA signature and its boot
	// code area (bytes 0-439) is not all zero. A GPT disk made by a
	// partitioning tool has a protective MBR with no code there.
	BIOSBootCode bool
	// GPT: sector 1 holds a GPT header ("EFI PART").
	GPT bool
	// ESP: an EFI system partition, by GPT type GUID or MBR type 0xEF.
	ESP bool
}

// UEFIOnly says that only UEFI can boot the disk: an EFI system partition
// and no BIOS boot code. Under SeaBIOS it would stop at "Boot failed: not
// a bootable disk" and wait forever.
func (s BootShape) UEFIOnly() bool { return s.ESP && !s.BIOSBootCode }

// BIOSOnly says that only BIOS can boot the disk: boot code in sector 0
// and no EFI system partition. OVMF would find no bootloader and stop in
// its boot menu.
func (s BootShape) BIOSOnly() bool { return s.BIOSBootCode && !s.ESP }

const sectorSize = 512

// espGUID is the EFI system partition's type GUID,
// C12A7328-F81F-11D2-BA4B-00A0C93EC93B, as stored on disk (the first three
// fields little-endian).
var espGUID = [16]byte{0x28, 0x73, 0x2a, 0xc1, 0x1f, 0xf8, 0xd2, 0x11, 0xba, 0x4b, 0x00, 0xa0, 0xc9, 0x3e, 0xc9, 0x3b}

// maxGPTEntries bounds the partition entries read (128 is what every tool
// writes).
const maxGPTEntries = 256

// ReadBootShape reads a disk's MBR and, when it has one, its GPT header and
// partition entries.
func ReadBootShape(r io.ReaderAt) (BootShape, error) {
	var s BootShape
	lba := make([]byte, 2*sectorSize)
	if n, err := r.ReadAt(lba, 0); n < len(lba) {
		if err == nil || errors.Is(err, io.EOF) {
			return s, nil // shorter than two sectors: nothing to boot
		}
		return s, fmt.Errorf("read the first sectors: %w", err)
	}
	mbr, hdr := lba[:sectorSize], lba[sectorSize:]
	signed := mbr[510] == 0x55 && mbr[511] == 0xaa
	s.BIOSBootCode = signed && !allZero(mbr[:440])
	if signed {
		for i := range 4 {
			if mbr[446+16*i+4] == 0xef {
				s.ESP = true
			}
		}
	}
	if !bytes.Equal(hdr[:8], []byte("EFI PART")) {
		return s, nil
	}
	s.GPT = true
	le := binary.LittleEndian
	entriesLBA, count, size := le.Uint64(hdr[72:]), le.Uint32(hdr[80:]), le.Uint32(hdr[84:])
	if size < 128 || size > 4096 || entriesLBA < 2 || entriesLBA > 1<<20 {
		return s, fmt.Errorf("gpt header: partition entries at lba %d of %d bytes", entriesLBA, size)
	}
	count = min(count, maxGPTEntries)
	entries := make([]byte, int(count)*int(size))
	if _, err := r.ReadAt(entries, int64(entriesLBA)*sectorSize); err != nil && !errors.Is(err, io.EOF) {
		return s, fmt.Errorf("read the gpt partition entries: %w", err)
	}
	for i := range int(count) {
		if bytes.Equal(entries[i*int(size):i*int(size)+16], espGUID[:]) {
			s.ESP = true
		}
	}
	return s, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// DiskBootShape reads the boot shape of an image's disk file, qcow2 (a
// self-contained file: see qcow2.Guest) or raw.
func DiskBootShape(path, format string) (BootShape, error) {
	if format == "raw" {
		f, err := os.Open(path)
		if err != nil {
			return BootShape{}, err
		}
		defer func() { _ = f.Close() }()
		return ReadBootShape(f)
	}
	g, err := qcow2.OpenGuest(path)
	if err != nil {
		return BootShape{}, err
	}
	defer func() { _ = g.Close() }()
	return ReadBootShape(g)
}

// FirmwareMismatch says why a disk cannot boot with firmware, or "" when
// it can (or its first sectors do not tell). image names it in the message.
func FirmwareMismatch(image, firmware string, s BootShape) string {
	switch {
	case firmware != FirmwareUEFI && s.UEFIOnly():
		return fmt.Sprintf("image %s is UEFI-only (an EFI system partition and no BIOS boot code in its first sector) but boots with firmware %q, "+
			"where it would stop at \"not a bootable disk\": set firmware = \"uefi\" on the image (kvm_image, or \"firmware\": \"uefi\" in its image.json)",
			image, FirmwareBIOS)
	case firmware == FirmwareUEFI && s.BIOSOnly():
		return fmt.Sprintf("image %s is BIOS-only (boot code in its first sector and no EFI system partition) but boots with firmware %q, "+
			"where OVMF would find no bootloader: set firmware = \"bios\" on the image", image, FirmwareUEFI)
	}
	return ""
}
