package image_test

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
)

// disk lays out the first 34 sectors of a disk: an MBR (with boot code or
// not, and up to four partition types) and optionally a GPT header whose
// partition entries (at LBA 2) carry the given type GUIDs.
type disk struct {
	bootCode bool
	mbrTypes []byte
	gptTypes [][16]byte
}

var (
	espType   = [16]byte{0x28, 0x73, 0x2a, 0xc1, 0x1f, 0xf8, 0xd2, 0x11, 0xba, 0x4b, 0x00, 0xa0, 0xc9, 0x3e, 0xc9, 0x3b}
	linuxType = [16]byte{0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d, 0xe4}
)

func (d disk) bytes() []byte {
	b := make([]byte, 34*512)
	if d.bootCode {
		copy(b, []byte{0xfa, 0x31, 0xc0, 0x8e, 0xd8}) // cli; xor ax,ax; mov ds,ax
	}
	for i, typ := range d.mbrTypes {
		b[446+16*i+4] = typ
	}
	b[510], b[511] = 0x55, 0xaa
	if d.gptTypes != nil {
		h := b[512:]
		copy(h, "EFI PART")
		le := binary.LittleEndian
		le.PutUint64(h[72:], 2)
		le.PutUint32(h[80:], 128)
		le.PutUint32(h[84:], 128)
		for i, g := range d.gptTypes {
			copy(b[1024+128*i:], g[:])
		}
	}
	return b
}

// The boot shape of the disks firmware meets, from their first sectors:
// a GPT disk as sfdisk makes it (protective MBR, no code) with an ESP is
// UEFI-only; an MBR disk with boot code and no ESP is BIOS-only; a hybrid
// (GRUB's boot code in a protective MBR and an ESP, as Debian's
// genericcloud images are) is either; a blank disk tells nothing.
func TestBootShapeFromFirstSectors(t *testing.T) {
	for _, c := range []struct {
		name               string
		d                  disk
		uefiOnly, biosOnly bool
		gpt, esp           bool
	}{
		{"gpt with esp, protective mbr", disk{mbrTypes: []byte{0xee}, gptTypes: [][16]byte{espType, linuxType}}, true, false, true, true},
		{"mbr with syslinux code", disk{bootCode: true, mbrTypes: []byte{0x0c, 0x83}}, false, true, false, false},
		{"hybrid gpt with boot code", disk{bootCode: true, mbrTypes: []byte{0xee}, gptTypes: [][16]byte{linuxType, espType}}, false, false, true, true},
		{"mbr esp without code", disk{mbrTypes: []byte{0xef, 0x83}}, true, false, false, true},
		{"gpt without esp nor code", disk{mbrTypes: []byte{0xee}, gptTypes: [][16]byte{linuxType}}, false, false, true, false},
		{"blank", disk{}, false, false, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := image.ReadBootShape(bytes.NewReader(c.d.bytes()))
			if err != nil {
				t.Fatal(err)
			}
			if s.UEFIOnly() != c.uefiOnly || s.BIOSOnly() != c.biosOnly || s.GPT != c.gpt || s.ESP != c.esp {
				t.Fatalf("shape %+v: uefi-only %v bios-only %v; want uefi-only %v bios-only %v gpt %v esp %v",
					s, s.UEFIOnly(), s.BIOSOnly(), c.uefiOnly, c.biosOnly, c.gpt, c.esp)
			}
		})
	}
	if s, err := image.ReadBootShape(bytes.NewReader(make([]byte, 100))); err != nil || s != (image.BootShape{}) {
		t.Fatalf("a 100-byte disk: %+v, %v; want nothing and no error", s, err)
	}
}

// The mismatch message names the image and says what to set.
func TestFirmwareMismatchSaysWhatToSet(t *testing.T) {
	uefiOnly := image.BootShape{GPT: true, ESP: true}
	msg := image.FirmwareMismatch("debian-uefi", "bios", uefiOnly)
	for _, want := range []string{"debian-uefi", "UEFI-only", `firmware = "uefi"`} {
		if !strings.Contains(msg, want) {
			t.Fatalf("message %q does not say %q", msg, want)
		}
	}
	if msg := image.FirmwareMismatch("x", "", uefiOnly); msg == "" {
		t.Fatal("a UEFI-only disk with no firmware named (bios) is accepted; want the mismatch")
	}
	if msg := image.FirmwareMismatch("x", "uefi", uefiOnly); msg != "" {
		t.Fatalf("a UEFI-only disk with firmware uefi is refused: %s", msg)
	}
	biosOnly := image.BootShape{BIOSBootCode: true}
	if msg := image.FirmwareMismatch("old", "uefi", biosOnly); !strings.Contains(msg, `firmware = "bios"`) {
		t.Fatalf("a BIOS-only disk under uefi: %q; want it to say firmware = \"bios\"", msg)
	}
	hybrid := image.BootShape{BIOSBootCode: true, GPT: true, ESP: true}
	for _, fw := range []string{"bios", "uefi"} {
		if msg := image.FirmwareMismatch("hybrid", fw, hybrid); msg != "" {
			t.Fatalf("a hybrid disk under %s is refused: %s", fw, msg)
		}
	}
}

// A manifest may name the firmware of a disk image; uefi for a kernel
// image, or an unknown firmware, is refused.
func TestManifestFirmware(t *testing.T) {
	m, err := image.ParseManifest([]byte(`{"kind": "disk", "disk": "d.qcow2", "firmware": "uefi"}`))
	if err != nil || m.EffectiveFirmware() != "uefi" {
		t.Fatalf("uefi disk image: %+v, %v", m, err)
	}
	if m, err := image.ParseManifest([]byte(`{"kind": "disk", "disk": "d.qcow2"}`)); err != nil || m.EffectiveFirmware() != "bios" {
		t.Fatalf("disk image without firmware: %+v, %v; want bios", m, err)
	}
	for _, bad := range []string{
		`{"kind": "kernel", "kernel": "vmlinuz", "firmware": "uefi"}`,
		`{"kind": "disk", "disk": "d.qcow2", "firmware": "efi"}`,
	} {
		if _, err := image.ParseManifest([]byte(bad)); err == nil {
			t.Fatalf("%s was accepted", bad)
		}
	}
}
