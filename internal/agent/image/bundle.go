package image

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"time"
)

// WriteBundle writes the kernel bundle of an image folder (its regular
// files, image.json among them, at the top level of a tar, sorted, with
// fixed times and modes, so the same folder always gives the same digest)
// to dst, through a temporary file renamed into place, and returns its
// sha256.
func WriteBundle(folder, dst string) (string, error) {
	des, err := os.ReadDir(folder)
	if err != nil {
		return "", err
	}
	var names []string
	for _, de := range des {
		if de.Type().IsRegular() && de.Name()[0] != '.' {
			names = append(names, de.Name())
		}
	}
	sort.Strings(names)
	if _, err := os.Stat(filepath.Join(folder, "image.json")); err != nil {
		return "", fmt.Errorf("bundle %s: %w", folder, err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".bundle-*")
	if err != nil {
		return "", err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	h := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(tmp, h))
	for _, n := range names {
		if err := addFile(tw, folder, n); err != nil {
			_ = tmp.Close()
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		_ = tmp.Close()
		return "", err
	}
	if err := tmp.Sync(); err != nil {
		_ = tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func addFile(tw *tar.Writer, folder, name string) error {
	f, err := os.Open(filepath.Join(folder, name))
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: fi.Size(), Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}
