package control_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// switchableTamper is a proxy in front of an agent that, while on, flips
// a byte of the volume content it passes and keeps the agent's digest
// header.
func switchableTamper(t *testing.T, agentURL string) (string, *atomic.Bool) {
	t.Helper()
	on := &atomic.Bool{}
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = func(resp *http.Response) error {
		if !on.Load() || !strings.HasSuffix(resp.Request.URL.Path, "/content") || resp.StatusCode != http.StatusOK {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		b[len(b)/2] ^= 0x01
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	srv := httptest.NewServer(proxy)
	t.Cleanup(srv.Close)
	return srv.URL, on
}

// The must-show of a move with the real qemu driver: a detached volume
// holding a marker moves between two agents. A tampered transfer is
// refused first (the volume stays ready on its source, nothing is left on
// the target, its reservation is released). Then the move: the target's
// copy has the sha256 the source sent, the source's copy is gone (GET 404,
// directory gone), and a busybox VM created with the volume lands on the
// new host and prints the marker from the volume's first bytes.
func TestVolumeMoveRealGuest(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
	if testing.Short() {
		t.Skip("boots a real guest")
	}
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a1 := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 2, MemoryMiB: 512, DiskMiB: 4096})
	a2 := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 2, MemoryMiB: 512, DiskMiB: 4096})
	proxy, tamper := switchableTamper(t, a1.URL)
	a1.AllowAddress(t, proxy)
	c.RegisterHost(t, "h1", proxy)
	c.RegisterHost(t, "h2", a2.Address)
	f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1, "h2": a2}}
	v := f.createVolume(t, api.VolumeCreate{Name: "pgdata", SizeMiB: 64, Host: "h1"})

	// The marker, written into the volume's qcow2 on h1 as a guest would.
	marker := "kvm-marker:" + v.ID
	buf := make([]byte, 512)
	copy(buf, marker)
	markerFile := filepath.Join(t.TempDir(), "marker")
	if err := os.WriteFile(markerFile, buf, 0o600); err != nil {
		t.Fatal(err)
	}
	srcDir := filepath.Join(a1.StateDir, "volumes", v.ID)
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -s "+markerFile+" 0 512", filepath.Join(srcDir, "disk.qcow2")).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v: %s", err, out)
	}
	body, sourceDigest, _, err := a1.Client.OpenVolumeContent(ctx, v.ID)
	if err != nil {
		t.Fatal(err)
	}
	_ = body.Close()

	// A tampered transfer is refused and changes nothing.
	tamper.Store(true)
	e := f.expectRefused(t, "tampered transfer", http.MethodPost, "/v1/volumes/pgdata/move", api.VolumeMove{Host: "h2"}, 503, api.CodeUnavailable)
	t.Logf("tampered transfer refused: %s", e.Message)
	if !strings.Contains(e.Message, "sha256") {
		t.Errorf("the refused move should say the digest did not match: %q", e.Message)
	}
	if _, err := a2.Client.GetVolume(ctx, v.ID); err == nil {
		t.Error("the target kept a copy of the refused transfer")
	}
	if entries, _ := os.ReadDir(filepath.Join(a2.StateDir, "volumes")); len(entries) > 0 {
		for _, en := range entries {
			if strings.Contains(en.Name(), v.ID) {
				t.Errorf("the target has %s after the refused transfer", en.Name())
			}
		}
	}
	if got := hostAllocated(t, c, "h2"); got.DiskMiB != 0 {
		t.Errorf("h2 allocates %d MiB after the refused move, want 0", got.DiskMiB)
	}
	tamper.Store(false)

	// The move.
	start := time.Now()
	moved, err := c.Client.MoveVolume(ctx, "pgdata", "h2")
	if err != nil {
		t.Fatalf("move pgdata to h2: %v", err)
	}
	t.Logf("move of a %d MiB volume took %v", v.SizeMiB, time.Since(start).Round(time.Millisecond))
	if moved.Host != "h2" || moved.State != api.VolumeReady {
		t.Fatalf("the move answered %+v; want ready on h2", moved)
	}
	onTarget, err := a2.Client.GetVolume(ctx, v.ID)
	if err != nil {
		t.Fatalf("the target does not have the volume: %v", err)
	}
	if onTarget.Source == nil || onTarget.Source.Peer == nil || onTarget.Source.Peer.Digest != sourceDigest {
		t.Errorf("the target's copy was pulled with %+v; want the source's digest %s", onTarget.Source, sourceDigest)
	}
	raw, err := os.ReadFile(filepath.Join(a2.StateDir, "volumes", v.ID, "disk.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	t.Logf("source export sha256 %s, target file sha256 %s", sourceDigest, hex.EncodeToString(sum[:]))
	if hex.EncodeToString(sum[:]) != sourceDigest {
		t.Errorf("the target's file has sha256 %x, the source sent %s", sum, sourceDigest)
	}
	if _, err := a1.Client.GetVolume(ctx, v.ID); err == nil || !strings.Contains(err.Error(), "404") && !strings.Contains(err.Error(), "not found") {
		t.Errorf("the source still answers for the volume: %v; want 404", err)
	}
	if _, err := os.Stat(srcDir); !os.IsNotExist(err) {
		t.Errorf("the source's directory %s is still there (%v)", srcDir, err)
	}
	checkLedger(t, c.Store)

	// A busybox VM with the volume lands on h2 and reads the marker.
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "reader", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		Volumes: []api.VMVolume{{Volume: "pgdata"}}}, "")
	if err != nil {
		t.Fatalf("VM with the moved volume: %v", err)
	}
	if vm.Host != "h2" {
		t.Fatalf("the VM with the moved volume is on %s, want h2", vm.Host)
	}
	want := regexp.QuoteMeta(marker)
	con := waitConsoleCount(t, a2, vm.ID, `kvm-guest-disk-marker vd[b-z] `+want, 1, 4*time.Minute)
	line := regexp.MustCompile(`kvm-guest-disk-marker vd[b-z] ` + want).FindString(con)
	t.Logf("guest on h2 prints: %s", line)
	checkLedger(t, c.Store)

	// A figure: the move of a volume that holds 256 MiB of data.
	big := f.createVolume(t, api.VolumeCreate{Name: "big", SizeMiB: 512, Host: "h1"})
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 256M",
		filepath.Join(a1.StateDir, "volumes", big.ID, "disk.qcow2")).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v: %s", err, out)
	}
	start = time.Now()
	if got, err := c.Client.MoveVolume(ctx, big.ID, "h2"); err != nil || got.Host != "h2" {
		t.Fatalf("move of volume big: %+v, %v", got, err)
	}
	t.Logf("move of a 512 MiB volume holding 256 MiB of data took %v", time.Since(start).Round(time.Millisecond))
	checkLedger(t, c.Store)
}
