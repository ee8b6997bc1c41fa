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
	manifest := map[string]any{"name": src.Name}
	switch src.Format {
	case agentapi.ImageFormatQCOW2:
		size, err := qcow2Size(blob)
		if err != nil {
			return st, fmt.Errorf("image %s is not a qcow2 file (format qcow2 was declared): %w; register it with its real format", src.Name, err)
		}
		st.VirtualSizeMiB = mib(size)
		manifest["kind"], manifest["disk"] = "disk", blobName(src.Format)
	case agentapi.ImageFormatRaw:
		if _, err := qcow2.ReadHeader(blob); !errors.Is(err, qcow2.ErrNotQcow2) {
			return st, fmt.Errorf("image %s is a qcow2 file but format raw was declared; register it with format qcow2", src.Name)
		}
		st.VirtualSizeMiB = mib(st.SizeBytes)
		manifest["kind"], manifest["disk"], manifest["disk_format"] = "disk", blobName(src.Format), "raw"
	case agentapi.ImageFormatKernel:
		m, err := unpackBundle(blob, stage)
		if err != nil {
			return st, fmt.Errorf("image %s is not a kernel bundle (a tar of image.json and the files it names): %w", src.Name, err)
		}
		if disk, _ := m["disk"].(string); disk != "" {
			size, err := qcow2Size(filepath.Join(stage, disk))
			if err != nil {
				return st, fmt.Errorf("image %s: disk %s of the bundle is not qcow2: %w", src.Name, disk, err)
			}
			st.VirtualSizeMiB = mib(size)
		}
		manifest = nil // the bundle's own image.json stays
	}
	if manifest != nil {
		if err := writeJSON(filepath.Join(stage, "image.json"), manifest); err != nil {
			return st, err
		}
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
// others. It returns the manifest.
func unpackBundle(tarPath, dir string) (map[string]any, error) {
	f, err := os.Open(tarPath)
	if err != nil {
		return nil, err
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
			return nil, err
		}
		name := strings.TrimPrefix(h.Name, "./")
		if h.Typeflag == tar.TypeDir && (name == "" || name == ".") {
			continue
		}
		if h.Typeflag != tar.TypeReg || name == "" || name != filepath.Base(name) || name[0] == '.' {
			return nil, fmt.Errorf("entry %q: only regular files at the top level are allowed", h.Name)
		}
		if len(files) >= maxTarFiles {
			return nil, fmt.Errorf("more than %d files", maxTarFiles)
		}
		if name == sourceFile {
			return nil, fmt.Errorf("entry %q is reserved", h.Name)
		}
		out, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
		if err != nil {
			return nil, err
		}
		if _, err := io.Copy(out, tr); err != nil { //nolint:gosec // the bundle's size was fixed by its digest
			_ = out.Close()
			if errors.Is(err, syscall.ENOSPC) {
				return nil, fmt.Errorf("the image directory is full (no space left on device): %w", err)
			}
			return nil, err
		}
		if err := out.Sync(); err != nil {
			_ = out.Close()
			return nil, err
		}
		if err := out.Close(); err != nil {
			return nil, err
		}
		files[name] = true
	}
	b, err := os.ReadFile(filepath.Join(dir, "image.json"))
	if err != nil {
		return nil, errors.New("no image.json at the top level")
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("image.json: %w", err)
	}
	kind, _ := m["kind"].(string)
	if kind != "kernel" && kind != "disk" {
		return nil, fmt.Errorf("image.json: kind %q: want kernel or disk", kind)
	}
	for _, k := range []string{"kernel", "initrd", "disk"} {
		if v, _ := m[k].(string); v != "" && !files[v] {
			return nil, fmt.Errorf("image.json names %s %q, which the tar does not hold", k, v)
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
