package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	imagecache "github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
)

// manifestFile is an image's manifest, one per image folder:
//
//	{"kind": "kernel", "kernel": "vmlinux", "initrd": "initrd.img",
//	 "cmdline": "console=ttyS0", "machine": "q35", "min_memory_mib": 64}
//	{"kind": "disk", "disk": "disk.qcow2"}
//
// File names are relative to the folder. A kernel image may also have a
// base disk; a VM's disk is a qcow2 overlay on it (or a blank disk).
const manifestFile = "image.json"

type manifest struct {
	Name         string `json:"name"`
	Kind         string `json:"kind"`
	Kernel       string `json:"kernel,omitempty"`
	Initrd       string `json:"initrd,omitempty"`
	Cmdline      string `json:"cmdline,omitempty"`
	Disk         string `json:"disk,omitempty"`
	Machine      string `json:"machine,omitempty"` // q35 (default) or microvm
	MinMemoryMiB int64  `json:"min_memory_mib,omitempty"`
	Build        string `json:"build,omitempty"`
	// DiskFormat is the format of Disk: qcow2 (default) or raw.
	DiskFormat string `json:"disk_format,omitempty"`
}

func (m *manifest) diskFormat() string {
	if m.DiskFormat == "" {
		return "qcow2"
	}
	return m.DiskFormat
}

// image is a manifest with its paths made absolute.
type image struct {
	manifest
	dir         string
	baseDiskMiB int64
}

func (d *Driver) path(img *image, name string) string {
	if name == "" {
		return ""
	}
	return filepath.Join(img.dir, name)
}

// loadImage reads and checks one image's manifest.
func (d *Driver) loadImage(name string) (*image, error) {
	dir, cached := imagecache.FolderOf(d.cacheDir(), name)
	if !cached {
		if d.opts.ImageDir == "" || name == "" || name != filepath.Base(name) || name == "." || name == ".." {
			return nil, fmt.Errorf("image %q: %w", name, agent.ErrUnknownImage)
		}
		dir = filepath.Join(d.opts.ImageDir, name)
	}
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("image %q: %w", name, agent.ErrUnknownImage)
	}
	if err != nil {
		return nil, err
	}
	img := &image{dir: dir}
	if err := json.Unmarshal(b, &img.manifest); err != nil {
		return nil, fmt.Errorf("image %s: %s: %w", name, manifestFile, err)
	}
	img.Name = name
	if img.Machine == "" {
		img.Machine = "q35"
	}
	if f := img.diskFormat(); f != "qcow2" && f != "raw" {
		return nil, fmt.Errorf("image %s: disk_format %q: want qcow2 or raw", name, f)
	}
	if img.Machine != "q35" && img.Machine != "microvm" {
		return nil, fmt.Errorf("image %s: machine %q: want q35 or microvm", name, img.Machine)
	}
	var need []string
	switch img.Kind {
	case agent.ImageKernel:
		if img.Kernel == "" {
			return nil, fmt.Errorf("image %s: a kernel image needs \"kernel\"", name)
		}
		need = append(need, img.Kernel, img.Initrd, img.Disk)
	case agent.ImageDisk:
		if img.Disk == "" {
			return nil, fmt.Errorf("image %s: a disk image needs \"disk\"", name)
		}
		if img.Machine == "microvm" {
			return nil, fmt.Errorf("image %s: firmware boot of a disk needs machine q35", name)
		}
		need = append(need, img.Disk)
	default:
		return nil, fmt.Errorf("image %s: kind %q: want kernel or disk", name, img.Kind)
	}
	for _, f := range need {
		if f == "" {
			continue
		}
		if _, err := os.Stat(d.path(img, f)); err != nil {
			return nil, fmt.Errorf("image %s: %w", name, err)
		}
	}
	if img.Disk != "" {
		size, err := d.diskSize(d.path(img, img.Disk))
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", name, err)
		}
		img.baseDiskMiB = (size + 1<<20 - 1) >> 20
	}
	return img, nil
}

// cacheDir is where the cache of registered images lives.
func (d *Driver) cacheDir() string {
	if d.opts.CacheDir != "" {
		return d.opts.CacheDir
	}
	return d.opts.ImageDir
}

func (d *Driver) diskSize(path string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, d.qemuImg, "info", "--output=json", "-U", path).Output()
	if err != nil {
		return 0, fmt.Errorf("qemu-img info %s: %w", path, err)
	}
	var info struct {
		VirtualSize int64 `json:"virtual-size"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		return 0, fmt.Errorf("qemu-img info %s: %w", path, err)
	}
	return info.VirtualSize, nil
}

// Images lists the images of the image directory whose manifest is valid.
func (d *Driver) Images() []string {
	names := []string{}
	if d.opts.ImageDir == "" {
		return names
	}
	entries, err := os.ReadDir(d.opts.ImageDir)
	if err != nil {
		return names
	}
	for _, e := range entries {
		if !e.IsDir() || e.Name()[0] == '.' {
			continue
		}
		if _, err := d.loadImage(e.Name()); err == nil {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names
}

// Image returns one image.
func (d *Driver) Image(name string) (agent.Image, error) {
	img, err := d.loadImage(name)
	if err != nil {
		return agent.Image{}, err
	}
	return agent.Image{Name: name, Kind: img.Kind, BaseDiskMiB: img.baseDiskMiB}, nil
}
