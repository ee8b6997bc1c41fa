package image

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
)

// ManifestFile is an image's manifest, one per image folder:
//
//	{"kind": "kernel", "kernel": "vmlinux", "initrd": "initrd.img",
//	 "cmdline": "console=ttyS0", "machine": "q35", "min_memory_mib": 64}
//	{"kind": "disk", "disk": "disk.qcow2"}
//	{"kind": "disk", "disk": "disk.qcow2", "firmware": "uefi"}
//
// File names are plain names of files in the folder. A kernel image may
// also have a base disk; a VM's disk is a qcow2 overlay on it (or a blank
// disk).
const ManifestFile = "image.json"

// Manifest is an image folder's image.json. Every driver reads it through
// ReadManifest, and the cache writes the one it keeps from these fields
// only, so that what was checked is what a driver opens.
type Manifest struct {
	Name         string `json:"name,omitempty"`
	Kind         string `json:"kind"` // kernel or disk
	Kernel       string `json:"kernel,omitempty"`
	Initrd       string `json:"initrd,omitempty"`
	Cmdline      string `json:"cmdline,omitempty"`
	Disk         string `json:"disk,omitempty"`
	Machine      string `json:"machine,omitempty"` // q35 (default) or microvm
	MinMemoryMiB int64  `json:"min_memory_mib,omitempty"`
	Build        string `json:"build,omitempty"`
	// DiskFormat is the format of Disk: qcow2 (default) or raw.
	DiskFormat string `json:"disk_format,omitempty"`
	// Firmware boots a disk image: bios (default, SeaBIOS) or uefi
	// (OVMF). A kernel image is booted by QEMU itself.
	Firmware string `json:"firmware,omitempty"`
}

// EffectiveFirmware is the firmware of the image, bios unless uefi is said.
func (m Manifest) EffectiveFirmware() string {
	if m.Firmware == "" {
		return FirmwareBIOS
	}
	return m.Firmware
}

// EffectiveDiskFormat is the format of Disk, qcow2 unless raw is said.
func (m Manifest) EffectiveDiskFormat() string {
	if m.DiskFormat == "" {
		return "qcow2"
	}
	return m.DiskFormat
}

// Image kinds of a manifest.
const (
	KindKernel = "kernel"
	KindDisk   = "disk"
)

// Files are the folder's files the manifest names, by key.
func (m Manifest) Files() map[string]string {
	files := map[string]string{}
	for k, v := range map[string]string{"kernel": m.Kernel, "initrd": m.Initrd, "disk": m.Disk} {
		if v != "" {
			files[k] = v
		}
	}
	return files
}

// ReadManifest reads and checks the manifest of an image folder. It is the
// one way a manifest is read, the operator's folders under --image-dir and
// the cache's alike.
func ReadManifest(dir string) (Manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return Manifest{}, err
	}
	m, err := ParseManifest(b)
	if err != nil {
		return Manifest{}, fmt.Errorf("%s: %w", ManifestFile, err)
	}
	return m, nil
}

// ParseManifest decodes a manifest strictly and checks it: the kind, the
// disk format, and that every file it names is a plain name of a file in
// the image folder (a name with a '/', "." or ".." would make a driver open
// a path of the host outside the folder, e.g. as the backing file of a VM's
// disk).
func ParseManifest(b []byte) (Manifest, error) {
	var m Manifest
	if err := decodeStrict(b, &m); err != nil {
		return Manifest{}, err
	}
	switch m.Kind {
	case KindKernel:
		if m.Kernel == "" {
			return Manifest{}, errors.New(`a kernel image needs "kernel"`)
		}
	case KindDisk:
		if m.Disk == "" {
			return Manifest{}, errors.New(`a disk image needs "disk"`)
		}
	default:
		return Manifest{}, fmt.Errorf("kind %q: want kernel or disk", m.Kind)
	}
	if m.DiskFormat != "" && m.DiskFormat != "qcow2" && m.DiskFormat != "raw" {
		return Manifest{}, fmt.Errorf("disk_format %q: want qcow2 or raw", m.DiskFormat)
	}
	if err := CheckFirmware(m.Firmware); err != nil {
		return Manifest{}, err
	}
	if m.Firmware == FirmwareUEFI && m.Kind != KindDisk {
		return Manifest{}, errors.New(`firmware "uefi" boots a disk image (kind disk); a kernel image is booted by QEMU directly`)
	}
	for _, k := range []string{"kernel", "initrd", "disk"} {
		if v, ok := m.Files()[k]; ok {
			if err := checkFileName(v); err != nil {
				return Manifest{}, fmt.Errorf("%s %q: %w", k, v, err)
			}
		}
	}
	return m, nil
}

// checkFileName accepts only the plain name of a file in the image folder.
func checkFileName(name string) error {
	if name == "." || name == ".." || strings.ContainsAny(name, "/\\\x00") || name != filepath.Base(name) {
		return errors.New("want the plain name of a file in the image folder (no '/', not '.' or '..')")
	}
	return nil
}

// decodeStrict decodes one JSON object into v, a pointer to a struct,
// refusing what encoding/json lets through: a key that is not exactly one
// of the struct's json names (encoding/json matches "DISK" or "diſk" to
// "disk"), a key given twice (the last would win) and anything after the
// object. The keys are checked on the raw tokens; only then are the values
// decoded.
func decodeStrict(b []byte, v any) error {
	known := jsonNames(reflect.TypeOf(v).Elem())
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return errors.New("want a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		if !known[key] {
			for k := range known {
				if strings.EqualFold(k, key) {
					return fmt.Errorf("key %q: keys are exact and lower-case; did you mean %q?", key, k)
				}
			}
			return fmt.Errorf("unknown key %q", key)
		}
		if seen[key] {
			return fmt.Errorf("key %q given twice", key)
		}
		seen[key] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return fmt.Errorf("key %q: %w", key, err)
		}
	}
	if _, err := dec.Token(); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("data after the JSON object")
	}
	return json.Unmarshal(b, v)
}

// jsonNames are the json keys of a struct's fields.
func jsonNames(t reflect.Type) map[string]bool {
	names := map[string]bool{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			names[name] = true
		}
	}
	return names
}
