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

// manifest is an image folder's image.json (imagecache.Manifest), read
// strictly and checked by imagecache.ReadManifest.
type manifest = imagecache.Manifest

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
	m, err := imagecache.ReadManifest(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("image %q: %w", name, agent.ErrUnknownImage)
	}
	if err != nil {
		return nil, fmt.Errorf("image %s: %w; fix the image folder %s", name, err, dir)
	}
	img := &image{manifest: m, dir: dir}
	img.Name = name
	if img.Machine == "" {
		img.Machine = "q35"
	}
	if img.Machine != "q35" && img.Machine != "microvm" {
		return nil, fmt.Errorf("image %s: machine %q: want q35 or microvm", name, img.Machine)
	}
	if img.Kind == agent.ImageDisk && img.Machine == "microvm" {
		return nil, fmt.Errorf("image %s: firmware boot of a disk needs machine q35", name)
	}
	for _, f := range img.Files() {
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
	return agent.Image{Name: name, Kind: img.Kind, BaseDiskMiB: img.baseDiskMiB, Firmware: img.EffectiveFirmware()}, nil
}
