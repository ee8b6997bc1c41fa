package qemu

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

// A snapshot of a VM of a registered image, pulled from another agent:
// its frozen disk names the image's base disk in the other agent's cache
// (<image dir>/sha256/<hex>/disk.qcow2), which is rewritten to this
// agent's copy, with the base's own format (raw for a raw image); a disk
// that names another image's base, or a file elsewhere, is refused.
func TestAdoptPulledRewritesARegisteredImagesBase(t *testing.T) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img is not installed")
	}
	const hex = "09fc3ea619445f60dfa86ae9a7c43c4ceeb731bc2762db3600dc4598c7ed9c70"
	for _, format := range []string{"qcow2", "raw"} {
		t.Run(format, func(t *testing.T) {
			cache := t.TempDir()
			folder := filepath.Join(cache, "sha256", hex)
			if err := os.MkdirAll(folder, 0o755); err != nil {
				t.Fatal(err)
			}
			disk := "disk." + format
			if out, err := exec.Command(qemuImg, "create", "-q", "-f", format, filepath.Join(folder, disk), "64M").CombinedOutput(); err != nil {
				t.Fatalf("qemu-img create: %v: %s", err, out)
			}
			manifest := `{"kind": "disk", "disk": "` + disk + `", "disk_format": "` + format + `", "firmware": "uefi"}`
			if err := os.WriteFile(filepath.Join(folder, "image.json"), []byte(manifest), 0o644); err != nil {
				t.Fatal(err)
			}
			d := &Driver{opts: Options{CacheDir: cache}, qemuImg: qemuImg, log: slog.Default()}
			for _, c := range []struct {
				backing string
				ok      bool
			}{
				{"/var/lib/kvmd/other-agent/images/sha256/" + hex + "/" + disk, true},
				{"/var/lib/kvmd/other-agent/images/sha256/" + strings.Repeat("a", 64) + "/" + disk, false},
				{"/etc/" + disk, false},
				{"/srv/" + hex + "/" + disk, false},
			} {
				snap := t.TempDir()
				if err := qcow2.WriteOverlay(filepath.Join(snap, "disk.qcow2"), c.backing, 64<<20); err != nil {
					t.Fatal(err)
				}
				_, err := d.AdoptPulled(t.Context(), snap, agent.SnapshotFiles{Disk: "disk.qcow2"}, agent.PulledFrom{Image: "sha256:" + hex})
				if !c.ok {
					if err == nil {
						t.Fatalf("a frozen disk on %s was adopted; want it refused", c.backing)
					}
					continue
				}
				if err != nil {
					t.Fatalf("frozen disk on %s: %v", c.backing, err)
				}
				h, err := qcow2.ReadHeader(filepath.Join(snap, "disk.qcow2"))
				if err != nil {
					t.Fatal(err)
				}
				if h.BackingFilename != filepath.Join(folder, disk) || h.BackingFormat != format {
					t.Fatalf("adopted frozen disk names %q (%s); want this agent's %s (%s)", h.BackingFilename, h.BackingFormat, filepath.Join(folder, disk), format)
				}
			}
		})
	}
}
