package agent_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	volA = "0f3c9a52-7b1e-4d2a-9c4e-1a2b3c4d5e6f"
	volB = "7d1e2f30-4a5b-4c6d-8e9f-a0b1c2d3e4f5"
)

// call sends one request to the harness's agent and returns the status and
// the decoded error code ("" for a success).
func call(t *testing.T, h *harness, method, path string, body any) (int, agentapi.ErrorDetail, []byte) {
	t.Helper()
	var in io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		in = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, h.srv.URL+path, in)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer func() { _ = resp.Body.Close() }()
	out, _ := io.ReadAll(resp.Body)
	var e agentapi.ErrorBody
	if resp.StatusCode >= 300 {
		_ = json.Unmarshal(out, &e)
	}
	return resp.StatusCode, e.Error, out
}

func TestVolumeCreateIsIdempotentOnID(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	spec := agentapi.VolumeSpec{SizeMiB: 64}
	if st, e, _ := call(t, h, http.MethodPut, "/v1/volumes/"+volA, spec); st != http.StatusCreated {
		t.Fatalf("first create: %d %+v, want 201", st, e)
	}
	st, e, body := call(t, h, http.MethodPut, "/v1/volumes/"+volA, spec)
	if st != http.StatusOK {
		t.Fatalf("same create again: %d %+v, want 200", st, e)
	}
	var v agentapi.Volume
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatal(err)
	}
	want := agentapi.Volume{ID: volA, SizeMiB: 64, Serial: "0f3c9a527b1e4d2a9c4e", State: agentapi.VolumeReady}
	v.AllocatedBytes = 0
	if v.ID != want.ID || v.SizeMiB != want.SizeMiB || v.Serial != want.Serial || v.State != want.State || v.AttachedTo != "" {
		t.Fatalf("volume = %+v, want %+v", v, want)
	}
	if st, e, _ := call(t, h, http.MethodPut, "/v1/volumes/"+volA, agentapi.VolumeSpec{SizeMiB: 65}); st != http.StatusConflict {
		t.Fatalf("create with another size: %d %+v, want 409", st, e)
	}
	if st, _, _ := call(t, h, http.MethodGet, "/v1/volumes/"+volB, nil); st != http.StatusNotFound {
		t.Fatalf("get unknown volume: %d, want 404", st)
	}
	for _, bad := range []agentapi.VolumeSpec{
		{SizeMiB: 0},
		{SizeMiB: 64, Source: &agentapi.VolumeSource{Volume: volB}},                // unknown source
		{SizeMiB: 32, Source: &agentapi.VolumeSource{Volume: volA}},                // below the source's size
		{SizeMiB: 64, Source: &agentapi.VolumeSource{Image: "sim", Volume: volA}},  // two sources
		{SizeMiB: 64, Source: &agentapi.VolumeSource{Image: "no-such-image-here"}}, // unknown image
	} {
		if st, e, _ := call(t, h, http.MethodPut, "/v1/volumes/"+volB, bad); st != http.StatusBadRequest {
			t.Errorf("create %+v: %d %+v, want 400", bad, st, e)
		}
	}
	list, err := h.client.ListVolumes(context.Background())
	if err != nil || len(list) != 1 || list[0].ID != volA {
		t.Fatalf("list = %+v, %v; want only %s", list, err, volA)
	}
	if err := h.client.DeleteVolume(context.Background(), volA); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if st, _, _ := call(t, h, http.MethodDelete, "/v1/volumes/"+volA, nil); st != http.StatusNoContent {
		t.Fatalf("delete again: %d, want 204", st)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "volumes", volA)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("volume directory after delete: %v, want gone", err)
	}
}

func TestVolumeResizeGrowsOnly(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 64}); err != nil {
		t.Fatal(err)
	}
	v, err := h.client.ResizeVolume(ctx, volA, 128)
	if err != nil || v.SizeMiB != 128 {
		t.Fatalf("grow: %+v, %v", v, err)
	}
	fi, err := os.Stat(filepath.Join(h.dir, "volumes", volA, "disk.qcow2"))
	if err != nil || fi.Size() != 128<<20 {
		t.Fatalf("disk after grow: %v, %v; want 128 MiB", fi, err)
	}
	if st, e, _ := call(t, h, http.MethodPost, "/v1/volumes/"+volA+"/resize", agentapi.VolumeResize{SizeMiB: 64}); st != http.StatusBadRequest {
		t.Fatalf("shrink: %d %+v, want 400", st, e)
	}
	if v, err := h.client.GetVolume(ctx, volA); err != nil || v.SizeMiB != 128 {
		t.Fatalf("after refused shrink: %+v, %v", v, err)
	}
}

// A clone shares its source's frozen disk; the source can be deleted
// first, and the shared base goes only with the last volume on it.
func TestVolumeCloneOutlivesItsSource(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 64}); err != nil {
		t.Fatal(err)
	}
	c, err := h.client.CreateVolume(ctx, volB, agentapi.VolumeSpec{SizeMiB: 96, Source: &agentapi.VolumeSource{Volume: volA}})
	if err != nil || c.SizeMiB != 96 || c.Source == nil || c.Source.Volume != volA {
		t.Fatalf("clone: %+v, %v", c, err)
	}
	bases := func() []string {
		entries, err := os.ReadDir(filepath.Join(h.dir, "volumes", ".bases"))
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		return names
	}
	if b := bases(); len(b) != 1 || !strings.HasPrefix(b[0], volA+"-") {
		t.Fatalf("bases after clone = %v, want one frozen from %s", b, volA)
	}
	if err := h.client.DeleteVolume(ctx, volA); err != nil {
		t.Fatalf("delete the source: %v", err)
	}
	if b := bases(); len(b) != 1 {
		t.Fatalf("bases after the source's delete = %v, want the clone's base kept", b)
	}
	if _, err := h.client.GetVolume(ctx, volB); err != nil {
		t.Fatalf("clone after the source's delete: %v", err)
	}
	if err := h.client.DeleteVolume(ctx, volB); err != nil {
		t.Fatal(err)
	}
	if b := bases(); len(b) != 0 {
		t.Fatalf("bases after the last volume's delete = %v, want none", b)
	}
}

// A crash after a volume's files are made and before they are in place:
// the next agent lists no half-made volume and leaves no file of it; a
// retried create makes it. Every volume that was complete is listed once.
func TestVolumeCreateCrashLeavesNothingHalfMade(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 64}); err != nil {
		t.Fatal(err)
	}
	h.stop()

	// The agent "dies" in the hook: the state directory as it is there is
	// copied, and the test goes on with that copy (what kill -9 leaves).
	crashed := t.TempDir()
	cfg := agent.Config{StateDir: dir, Driver: sim.New(sim.Options{}), Token: token,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	hooked := 0
	agent.SetVolumeHook(&cfg, func(id string) error {
		hooked++
		if out, err := exec.Command("cp", "-a", dir+"/.", crashed).CombinedOutput(); err != nil {
			t.Fatalf("copy state: %v: %s", err, out)
		}
		return errors.New("killed")
	})
	a, err := agent.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(a.Handler())
	cl := agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0))
	if _, err := cl.CreateVolume(ctx, volB, agentapi.VolumeSpec{SizeMiB: 64, Source: &agentapi.VolumeSource{Volume: volA}}); err == nil || hooked != 1 {
		t.Fatalf("create with the crash hook: %v (hook ran %d times), want it to fail in the hook", err, hooked)
	}
	srv.Close()
	_ = a.Close()

	h2 := startHarness(t, crashed, 0)
	list, err := h2.client.ListVolumes(ctx)
	if err != nil || len(list) != 1 || list[0].ID != volA {
		t.Fatalf("volumes after the crash = %+v, %v; want only %s, once", list, err, volA)
	}
	entries, _ := os.ReadDir(filepath.Join(crashed, "volumes"))
	for _, e := range entries {
		if e.Name() != volA && e.Name() != ".bases" {
			t.Errorf("left after the crash: volumes/%s", e.Name())
		}
	}
	// The clone had moved the source onto an overlay of the frozen base
	// (recorded), so the source keeps that base and nothing else.
	if b, _ := os.ReadDir(filepath.Join(crashed, "volumes", ".bases")); len(b) != 1 {
		t.Errorf("bases after the crash: %d, want the source's one", len(b))
	}
	files, _ := os.ReadDir(filepath.Join(crashed, "volumes", volA))
	if len(files) != 2 {
		t.Errorf("files of %s after the crash: %d, want its metadata and one disk", volA, len(files))
	}
	if _, err := h2.client.CreateVolume(ctx, volB, agentapi.VolumeSpec{SizeMiB: 64, Source: &agentapi.VolumeSource{Volume: volA}}); err != nil {
		t.Fatalf("retried create after the crash: %v", err)
	}
	h2.stop()
	h3 := startHarness(t, crashed, 0)
	list, err = h3.client.ListVolumes(ctx)
	if err != nil || len(list) != 2 {
		t.Fatalf("volumes after a restart = %+v, %v; want 2", list, err)
	}
}

func TestVolumeAttachAtCreateAndHot(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	for _, id := range []string{volA, volB} {
		if _, err := h.client.CreateVolume(ctx, id, agentapi.VolumeSpec{SizeMiB: 64}); err != nil {
			t.Fatal(err)
		}
	}
	withVol := spec
	withVol.Volumes = []agentapi.VolumeAttachment{{ID: volA}}
	vm, err := h.client.CreateVM(ctx, "vm-1", withVol)
	if err != nil {
		t.Fatalf("create vm with a volume: %v", err)
	}
	if len(vm.Volumes) != 1 || vm.Volumes[0].ID != volA {
		t.Fatalf("vm volumes = %+v", vm.Volumes)
	}
	if p := h.driver.Plugged("vm-1"); !slices.Equal(p, []string{volA}) {
		t.Fatalf("plugged at boot = %v, want [%s]", p, volA)
	}
	if v, _ := h.client.GetVolume(ctx, volA); v.AttachedTo != "vm-1" || v.ReadOnly {
		t.Fatalf("volume = %+v, want attached read-write to vm-1", v)
	}

	// Bad input: each a clear 4xx, nothing changed.
	other := spec
	other.Volumes = []agentapi.VolumeAttachment{{ID: volA, ReadOnly: true}}
	if st, e, _ := call(t, h, http.MethodPut, "/v1/vms/vm-2", other); st != http.StatusConflict || e.Code != agent.CodeVolumeAttached || !strings.Contains(e.Message, "vm-1") {
		t.Fatalf("second vm on a read-write volume: %d %+v, want 409 volume_attached naming vm-1", st, e)
	}
	other.Volumes = []agentapi.VolumeAttachment{{ID: "no-such-volume"}}
	if st, e, _ := call(t, h, http.MethodPut, "/v1/vms/vm-2", other); st != http.StatusBadRequest || !strings.Contains(e.Message, "no-such-volume") {
		t.Fatalf("unknown volume: %d %+v, want 400 naming it", st, e)
	}
	if _, err := h.client.GetVM(ctx, "vm-2"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("vm-2 after refused creates: %v, want not found", err)
	}
	st, e, _ := call(t, h, http.MethodDelete, "/v1/volumes/"+volA, nil)
	if st != http.StatusConflict || e.Code != agent.CodeVolumeAttached || e.Details["vm"] != "vm-1" {
		t.Fatalf("delete attached volume: %d %+v, want 409 volume_attached naming vm-1", st, e)
	}

	// Hot attach and detach.
	if _, err := h.client.AttachVolume(ctx, "vm-1", volB, true); err != nil {
		t.Fatalf("hot attach: %v", err)
	}
	if _, err := h.client.AttachVolume(ctx, "vm-1", volB, true); err != nil {
		t.Fatalf("hot attach again: %v", err)
	}
	if p := h.driver.Plugged("vm-1"); !slices.Equal(p, []string{volA, volB}) {
		t.Fatalf("plugged after hot attach = %v", p)
	}
	if st, e, _ := call(t, h, http.MethodPut, "/v1/vms/vm-1/volumes/"+volB, agentapi.VolumeAttachment{}); st != http.StatusConflict {
		t.Fatalf("attach again read-write: %d %+v, want 409", st, e)
	}
	if err := h.client.DetachVolume(ctx, "vm-1", volA); err != nil {
		t.Fatalf("hot detach: %v", err)
	}
	if err := h.client.DetachVolume(ctx, "vm-1", volA); err != nil {
		t.Fatalf("detach again: %v", err)
	}
	if p := h.driver.Plugged("vm-1"); !slices.Equal(p, []string{volB}) {
		t.Fatalf("plugged after hot detach = %v", p)
	}

	// Attachments survive an agent restart.
	h.stop()
	h2 := startHarness(t, dir, 0)
	vm, err = h2.client.GetVM(ctx, "vm-1")
	if err != nil || len(vm.Volumes) != 1 || vm.Volumes[0].ID != volB || !vm.Volumes[0].ReadOnly {
		t.Fatalf("vm after restart = %+v, %v; want %s read-only attached", vm.Volumes, err, volB)
	}
	if v, _ := h2.client.GetVolume(ctx, volB); v.AttachedTo != "vm-1" || !v.ReadOnly {
		t.Fatalf("volume after restart = %+v", v)
	}

	// Deleting the VM detaches; the volume stays and can then be deleted.
	if err := h2.client.DeleteVM(ctx, "vm-1"); err != nil {
		t.Fatal(err)
	}
	if v, err := h2.client.GetVolume(ctx, volB); err != nil || v.AttachedTo != "" {
		t.Fatalf("volume after its vm's delete = %+v, %v; want kept, detached", v, err)
	}
	if err := h2.client.DeleteVolume(ctx, volB); err != nil {
		t.Fatalf("delete detached volume: %v", err)
	}
}

// The source side of a move: the content comes with the sha256 of what is
// sent, and a volume that a running VM has attached is refused.
func TestVolumeContentStreamsWithItsDigest(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 1}); err != nil {
		t.Fatal(err)
	}
	marker := []byte("kvm-marker:volume-content")
	if err := os.WriteFile(filepath.Join(h.dir, "volumes", volA, "disk.qcow2"), marker, 0o600); err != nil {
		t.Fatal(err)
	}
	body, digest, size, err := h.client.OpenVolumeContent(ctx, volA)
	if err != nil {
		t.Fatalf("content: %v", err)
	}
	got, err := io.ReadAll(body)
	_ = body.Close()
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(got)
	if !bytes.Equal(got, marker) || digest != hex.EncodeToString(sum[:]) || size != 1 {
		t.Fatalf("content %q with sha256 %s, size_mib %d; want %q with its digest, 1", got, digest, size, marker)
	}
	if entries, _ := os.ReadDir(filepath.Join(h.dir, "volumes")); len(entries) != 2 {
		t.Fatalf("volumes directory after an export has %d entries, want the volume and .bases", len(entries))
	}
	withVol := spec
	withVol.Volumes = []agentapi.VolumeAttachment{{ID: volA}}
	if _, err := h.client.CreateVM(ctx, "vm-1", withVol); err != nil {
		t.Fatal(err)
	}
	if st, e, _ := call(t, h, http.MethodGet, "/v1/volumes/"+volA+"/content", nil); st != http.StatusConflict || e.Code != agent.CodeVolumeAttached {
		t.Fatalf("content of an attached volume: %d %+v, want 409 volume_attached", st, e)
	}
}

// A move: the target pulls the volume from the source agent after the
// source proved its pinned identity, with the digest checked while it
// streams; a transfer whose digest is not the expected one is refused and
// leaves nothing.
func TestVolumePullFromPeer(t *testing.T) {
	src := startHarness(t, t.TempDir(), 0)
	dst := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := src.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 1}); err != nil {
		t.Fatal(err)
	}
	marker := []byte("kvm-marker:moved")
	if err := os.WriteFile(filepath.Join(src.dir, "volumes", volA, "disk.qcow2"), marker, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(marker)
	peer := &agentapi.VolumePeer{Agent: src.srv.URL, PublicKey: agentapi.EncodeKey(src.agent.PublicKey())}

	peer.Digest = strings.Repeat("0", 64) // what a tampered transfer looks like to the puller
	bad := agentapi.VolumeSpec{SizeMiB: 1, Source: &agentapi.VolumeSource{Peer: peer}}
	if st, e, _ := call(t, dst, http.MethodPut, "/v1/volumes/"+volA, bad); st != http.StatusBadGateway || !strings.Contains(e.Message, "sha256") {
		t.Fatalf("pull with another digest: %d %+v, want 502 naming the digest", st, e)
	}
	if entries, _ := os.ReadDir(filepath.Join(dst.dir, "volumes")); len(entries) != 1 {
		t.Fatalf("target's volumes directory after a refused pull has %d entries, want only .bases", len(entries))
	}

	peer.Digest = hex.EncodeToString(sum[:])
	v, err := dst.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 2, Source: &agentapi.VolumeSource{Peer: peer}})
	if err != nil || v.SizeMiB != 2 {
		t.Fatalf("pull: %+v, %v", v, err)
	}
	got, err := os.ReadFile(filepath.Join(dst.dir, "volumes", volA, "disk.qcow2"))
	if err != nil || !bytes.HasPrefix(got, marker) || len(got) != 2<<20 {
		t.Fatalf("pulled file: %d bytes starting %q, %v; want the marker, grown to 2 MiB", len(got), got[:min(len(got), 16)], err)
	}

	// A source that is not the pinned agent gets no token and no pull.
	other := startHarness(t, t.TempDir(), 0)
	wrong := &agentapi.VolumePeer{Agent: src.srv.URL, PublicKey: agentapi.EncodeKey(other.agent.PublicKey())}
	if _, err := other.client.CreateVolume(ctx, volA, agentapi.VolumeSpec{SizeMiB: 1, Source: &agentapi.VolumeSource{Peer: wrong}}); err == nil || !strings.Contains(err.Error(), "identity") {
		t.Fatalf("pull from an agent that does not hold the pinned key: %v, want refused for its identity", err)
	}
}
