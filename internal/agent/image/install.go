package image

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// maxTarFiles bounds a kernel bundle.
const maxTarFiles = 64

// install checks that the verified bytes in partial are of the declared
// format, builds the image folder beside the cache and renames it into
// place. The format check fails the image with a reason and removes the
// bytes: nothing of a wrong image stays.
func (c *Cache) install(src agentapi.ImageSource, partial, from string) (agentapi.ImageStatus, error) {
	stage, err := os.MkdirTemp(c.dir, stagePrefix+src.SHA256+"-")
	if err != nil {
		return agentapi.ImageStatus{}, fmt.Errorf("image %s: %w", src.Name, err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(stage)
			_ = os.Remove(partial)
		}
	}()
	st := agentapi.ImageStatus{SHA256: src.SHA256, Name: src.Name, Format: src.Format, Status: agentapi.ImageReady, From: from}
	fi, err := os.Stat(partial)
	if err != nil {
		return st, err
	}
	st.SizeBytes = fi.Size()
	blob := filepath.Join(stage, blobName(src.Format))
	if err := os.Rename(partial, blob); err != nil {
		return st, fmt.Errorf("image %s: %w", src.Name, err)
	}
	// The manifest the cache keeps is written from checked fields only,
	// never a bundle's own image.json: what was checked is what a driver
	// opens.
	manifest := Manifest{Name: src.Name, Kind: KindDisk, Disk: blobName(src.Format)}
	switch src.Format {
	case agentapi.ImageFormatQCOW2:
		size, err := qcow2Size(blob)
		if err != nil {
			return st, fmt.Errorf("image %s is not a qcow2 file (format qcow2 was declared): %w; register it with its real format", src.Name, err)
		}
		st.VirtualSizeMiB = mib(size)
	case agentapi.ImageFormatRaw:
		if _, err := qcow2.ReadHeader(blob); !errors.Is(err, qcow2.ErrNotQcow2) {
			return st, fmt.Errorf("image %s is a qcow2 file but format raw was declared; register it with format qcow2", src.Name)
		}
		st.VirtualSizeMiB = mib(st.SizeBytes)
		manifest.DiskFormat = "raw"
	case agentapi.ImageFormatKernel:
		m, err := unpackBundle(blob, stage)
		if err != nil {
			return st, fmt.Errorf("image %s is not a kernel bundle (a tar of image.json and the files it names): %w", src.Name, err)
		}
		if m.Disk != "" {
			size, err := qcow2Size(filepath.Join(stage, m.Disk))
			if err != nil {
				return st, fmt.Errorf("image %s: disk %s of the bundle is not qcow2: %w", src.Name, m.Disk, err)
			}
			st.VirtualSizeMiB = mib(size)
		}
		manifest = m
		manifest.Name = src.Name
	}
	if err := writeJSON(filepath.Join(stage, ManifestFile), manifest); err != nil {
		return st, err
	}
	if err := writeJSON(filepath.Join(stage, sourceFile), st); err != nil {
		return st, err
	}
	if err := syncDir(stage); err != nil {
		return st, err
	}
	final := filepath.Join(c.dir, src.SHA256)
	_ = os.RemoveAll(final) // a folder left without its source file
	if err := os.Rename(stage, final); err != nil {
		return st, fmt.Errorf("image %s: %w", src.Name, err)
	}
	ok = true
	if err := syncDir(c.dir); err != nil {
		c.log.Warn("sync image cache directory", "err", err)
	}
	return st, nil
}

func mib(b int64) int64 { return (b + 1<<20 - 1) >> 20 }

// qcow2Size reads the virtual size from a qcow2 header, so that every
// driver, the sim too, checks the format the same way. An image must be
// one self-contained plain qcow2 file: a backing file or an external data
// file would make QEMU open a path of the host named inside the image.
func qcow2Size(path string) (int64, error) {
	h, err := qcow2.ReadHeader(path)
	if err != nil {
		return 0, err
	}
	if h.BackingFilename != "" {
		return 0, fmt.Errorf("it names a backing file (%q), which is refused: an image must be self-contained "+
			"(make one with qemu-img convert -O qcow2)", h.BackingFilename)
	}
	return h.VirtualSize, nil
}

// unpackBundle extracts a kernel bundle: a tar of regular files at its top
// level (no folders, links or paths), one of them image.json naming the
// others. It returns the manifest, checked.
func unpackBundle(tarPath, dir string) (Manifest, error) {
	f, err := os.Open(tarPath)
	if err != nil {
		return Manifest{}, err
	}
	defer func() { _ = f.Close() }()
	tr := tar.NewReader(f)
	files := map[string]bool{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return Manifest{}, err
		}
		name := strings.TrimPrefix(h.Name, "./")
		if h.Typeflag == tar.TypeDir && (name == "" || name == ".") {
			continue
		}
		if h.Typeflag != tar.TypeReg || name == "" || name != filepath.Base(name) || name[0] == '.' {
			return Manifest{}, fmt.Errorf("entry %q: only regular files at the top level are allowed", h.Name)
		}
		if len(files) >= maxTarFiles {
			return Manifest{}, fmt.Errorf("more than %d files", maxTarFiles)
		}
		if name == sourceFile {
			return Manifest{}, fmt.Errorf("entry %q is reserved", h.Name)
		}
		out, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
		if err != nil {
			return Manifest{}, err
		}
		if _, err := io.Copy(out, tr); err != nil { //nolint:gosec // the bundle's size was fixed by its digest
			_ = out.Close()
			if errors.Is(err, syscall.ENOSPC) {
				return Manifest{}, fmt.Errorf("the image directory is full (no space left on device): %w", err)
			}
			return Manifest{}, err
		}
		if err := out.Sync(); err != nil {
			_ = out.Close()
			return Manifest{}, err
		}
		if err := out.Close(); err != nil {
			return Manifest{}, err
		}
		files[name] = true
	}
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return Manifest{}, errors.New("no image.json at the top level")
	}
	m, err := ParseManifest(b)
	if err != nil {
		return Manifest{}, fmt.Errorf("image.json: %w", err)
	}
	if m.DiskFormat != "" && m.DiskFormat != "qcow2" {
		return Manifest{}, fmt.Errorf("image.json: disk_format %q: a bundle's disk is qcow2", m.DiskFormat)
	}
	for k, v := range m.Files() {
		if !files[v] {
			return Manifest{}, fmt.Errorf("image.json names %s %q, which the tar does not hold", k, v)
		}
	}
	return m, nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}
