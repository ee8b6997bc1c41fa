package cmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// registerDevImages registers each image folder of the image directory
// (busybox from make image, debian-12 from make image-debian) as an image
// like any other: a kernel bundle of the folder, written once into
// bundleDir, by file:// URL and sha256. The local agent then fetches it
// into its cache the first time a VM needs it. An image already
// registered under that name with the same digest is kept; one with
// another digest is left alone and reported.
func registerDevImages(ctx context.Context, c *client.Client, imageDir, bundleDir string, stderr io.Writer) error {
	if imageDir == "" {
		return nil
	}
	des, err := os.ReadDir(imageDir)
	if err != nil {
		return fmt.Errorf("read image directory %s: %w", imageDir, err)
	}
	if err := os.MkdirAll(bundleDir, 0o750); err != nil {
		return err
	}
	var errs []error
	for _, de := range des {
		folder := filepath.Join(imageDir, de.Name())
		manifest, err := os.Stat(filepath.Join(folder, "image.json"))
		if !de.IsDir() || err != nil {
			continue
		}
		tarPath := filepath.Join(bundleDir, de.Name()+".tar")
		sha, err := bundleOnce(folder, tarPath, manifest.ModTime().Unix())
		if err != nil {
			errs = append(errs, fmt.Errorf("bundle image %s: %w", de.Name(), err))
			continue
		}
		_, err = c.CreateImage(ctx, api.ImageCreate{Name: de.Name(), SourceURL: "file://" + tarPath, SHA256: sha, Format: api.ImageFormatKernel})
		if errors.Is(err, client.ErrConflict) {
			if got, gerr := c.GetImage(ctx, de.Name()); gerr == nil && got.SHA256 != sha {
				fmt.Fprintf(stderr, "kvmd dev: image %q is registered with sha256 %s, but %s now bundles to %s; delete the image to register the new one\n",
					de.Name(), got.SHA256, folder, sha)
			}
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("register image %s: %w", de.Name(), err))
			continue
		}
		fmt.Fprintf(stderr, "kvmd dev: registered image %q (kernel bundle %s, sha256 %s)\n", de.Name(), tarPath, sha)
	}
	return errors.Join(errs...)
}

// bundleOnce writes the bundle of folder unless tarPath holds one made
// since the folder's image.json last changed (a digest file beside it
// records the digest), and returns its sha256.
func bundleOnce(folder, tarPath string, manifestTime int64) (string, error) {
	digestFile := tarPath + ".sha256"
	if fi, err := os.Stat(tarPath); err == nil && fi.ModTime().Unix() >= manifestTime {
		if b, err := os.ReadFile(digestFile); err == nil && image.ValidDigest(string(b)) {
			return string(b), nil
		}
	}
	sha, err := image.WriteBundle(folder, tarPath)
	if err != nil {
		return "", err
	}
	return sha, os.WriteFile(digestFile, []byte(sha), 0o640)
}
