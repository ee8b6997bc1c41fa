package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	imagecache "github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

// AdoptPulled implements agent.Snapshotter. It walks the chain from the
// frozen disk down: a backing name that is a plain name of the snapshot's
// own disk files goes on down the chain; one that resolves to a disk file
// of the parent snapshot, or that names the base disk of the snapshot's
// image (<image>/<disk file>, or sha256/<hex>/<disk file> for a registered
// image, wherever the other agent keeps its images), ends it. Each name is
// rewritten to this agent's file where it differs, with qemu-img rebase -u
// (the header only), and the backing format is always named (qcow2, or the
// base disk's own: a raw image's is raw), so nothing is probed. Every listed backing file must be in
// the chain, every disk a plain qcow2 file (no external data file, no
// encryption: qcow2.ReadHeader), and anything else is refused.
func (d *Driver) AdoptPulled(ctx context.Context, dir string, files agent.SnapshotFiles, from agent.PulledFrom) ([]string, error) {
	if files.Disk == "" {
		if len(files.Backing) > 0 {
			return nil, fmt.Errorf("backing files %v without a frozen disk", files.Backing)
		}
		return nil, nil
	}
	own := append([]string{files.Disk}, files.Backing...)
	var parentDisks []string
	if from.ParentDir != "" && from.ParentFiles.Disk != "" {
		parentDisks = append([]string{from.ParentFiles.Disk}, from.ParentFiles.Backing...)
	}
	base, baseFormat := "", ""
	if img, err := d.loadImage(from.Image); err != nil {
		return nil, fmt.Errorf("image %s: %w", from.Image, err)
	} else if img.Disk != "" {
		base, baseFormat = d.path(img, img.Disk), img.EffectiveDiskFormat()
	}
	// The folder a base disk is in, under any agent's image directory.
	baseFolder := from.Image
	if hex, ok := imagecache.DigestOfRef(from.Image); ok {
		baseFolder = filepath.Join("sha256", hex)
	}
	var rewritten []string
	visited := map[string]bool{}
	for name := files.Disk; name != ""; {
		if visited[name] {
			return nil, fmt.Errorf("disk %s: its backing chain loops", name)
		}
		visited[name] = true
		path := filepath.Join(dir, name)
		// Read here (agent/qcow2), not by qemu-img: strict, and no process
		// per file of the chain.
		h, err := qcow2.ReadHeader(path)
		if err != nil {
			return nil, err
		}
		bf, next, want, wantFormat := h.BackingFilename, "", "", "qcow2"
		switch {
		case bf == "":
			// A blank disk: the chain ends here.
		case !strings.ContainsAny(bf, "/:") && slices.Contains(own, bf) && bf != name:
			want, next = bf, bf
		case from.ParentDir != "" && parentFile(dir, bf, from.ParentDir, parentDisks) != "":
			rel, err := filepath.Rel(dir, filepath.Join(from.ParentDir, parentFile(dir, bf, from.ParentDir, parentDisks)))
			if err != nil {
				return nil, err
			}
			want = rel
		case base != "" && !strings.HasPrefix(bf, "json:") && filepath.Base(bf) == filepath.Base(base) &&
			strings.HasSuffix(filepath.Dir(filepath.Clean(bf)), string(filepath.Separator)+baseFolder):
			want, wantFormat = base, baseFormat
		default:
			return nil, fmt.Errorf("disk %s names backing file %q, which is neither a disk of the snapshot, nor of its parent snapshot, nor the base disk of image %s: refused",
				name, bf, from.Image)
		}
		if bf != "" && (bf != want || h.BackingFormat != wantFormat) {
			if err := d.rebaseHeader(ctx, path, want, wantFormat); err != nil {
				return nil, err
			}
			rewritten = append(rewritten, name)
		}
		name = next
	}
	for _, b := range files.Backing {
		if !visited[b] {
			return nil, fmt.Errorf("backing file %s is listed but is not in the frozen disk's chain", b)
		}
	}
	return rewritten, nil
}

// parentFile returns the name of the parent's disk file that backing,
// resolved from dir as QEMU resolves it, is; "" when it is none of them.
func parentFile(dir, backing, parentDir string, parentDisks []string) string {
	if strings.HasPrefix(backing, "json:") || strings.Contains(backing, "\\") {
		return ""
	}
	p := backing
	if !filepath.IsAbs(p) {
		p = filepath.Join(dir, p)
	}
	p = filepath.Clean(p)
	if filepath.Dir(p) != filepath.Clean(parentDir) || !slices.Contains(parentDisks, filepath.Base(p)) {
		return ""
	}
	return filepath.Base(p)
}

// rebaseHeader points path's backing file at backing (of format) without
// touching its data: the file is this agent's own pull, still writable.
func (d *Driver) rebaseHeader(ctx context.Context, path, backing, format string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := os.Chmod(path, 0o640); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, d.qemuImg, "rebase", "-q", "-u", "-f", "qcow2", "-b", backing, "-F", format, path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img rebase -u %s onto %s: %w: %s", filepath.Base(path), backing, err, bytes.TrimSpace(out))
	}
	return nil
}
