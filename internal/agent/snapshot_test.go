package agent_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// snapDriver is the sim driver counting the snapshots it takes, so that a
// test can prove that a retried snapshot did not pause its VM again.
type snapDriver struct {
	*sim.Driver
	snapshots atomic.Int64
}

func (d *snapDriver) Snapshot(ctx context.Context, m *agent.Machine, dir string, o agent.SnapshotOptions) (agent.SnapshotFiles, error) {
	d.snapshots.Add(1)
	return d.Driver.Snapshot(ctx, m, dir, o)
}

type snapAgent struct {
	dir    string
	driver *snapDriver
	agent  *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
}

func startSnapAgent(t *testing.T, dir string) *snapAgent {
	t.Helper()
	d := &snapDriver{Driver: sim.New(sim.Options{})}
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: dir, Driver: d, Token: token,
		Capacity: agentapi.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 1 << 20},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	srv := httptest.NewServer(a.Handler())
	s := &snapAgent{dir: dir, driver: d, agent: a, srv: srv,
		client: agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0))}
	t.Cleanup(func() {
		srv.Close()
		_ = a.Close()
	})
	return s
}

func (s *snapAgent) snapshotDirs(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(s.dir, "snapshots"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func (s *snapAgent) vmDirs(t *testing.T) []string {
	t.Helper()
	entries, _ := os.ReadDir(filepath.Join(s.dir, "vms"))
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func TestSnapshotIsTakenOnceAndSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s := startSnapAgent(t, dir)
	ctx := context.Background()
	if _, err := s.client.CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}

	// Eight PUTs at once: one snapshot, the same answer for all.
	const n = 8
	got := make(chan agentapi.Snapshot, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			snap, err := s.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"})
			if err != nil {
				t.Errorf("concurrent snapshot: %v", err)
			}
			got <- snap
		}()
	}
	wg.Wait()
	close(got)
	first := <-got
	for snap := range got {
		if snap.SHA256 != first.SHA256 || !snap.CreatedAt.Equal(first.CreatedAt) {
			t.Fatalf("concurrent PUTs answered different snapshots: %+v and %+v", first, snap)
		}
	}
	if c := s.driver.snapshots.Load(); c != 1 {
		t.Fatalf("driver snapshots = %d after %d PUTs, want 1", c, n)
	}
	if first.VMID != "src" || first.Image != "sim" || first.MemoryMiB != spec.MemoryMiB || len(first.Files) != 2 || first.SizeBytes == 0 {
		t.Fatalf("snapshot = %+v", first)
	}
	if vm, _ := s.client.GetVM(ctx, "src"); vm.State != agentapi.StateRunning {
		t.Fatalf("source after snapshot = %+v, want running", vm)
	}
	if dirs := s.snapshotDirs(t); len(dirs) != 1 || dirs[0] != "fork-1" {
		t.Fatalf("snapshot directories = %v, want [fork-1]", dirs)
	}

	// The same id for another VM is a conflict, not a second snapshot.
	if _, err := s.client.CreateVM(ctx, "other", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := s.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "other"}); statusOf(err) != http.StatusConflict {
		t.Fatalf("same id, other vm: %v, want 409", err)
	}
	// A stopped VM cannot be snapshotted; an unknown one is not found.
	if _, err := s.client.Action(ctx, "other", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	if _, err := s.client.CreateSnapshot(ctx, "fork-2", agentapi.SnapshotSpec{VMID: "other"}); statusOf(err) != http.StatusConflict ||
		!strings.Contains(err.Error(), "stopped") {
		t.Fatalf("snapshot of a stopped vm: %v, want 409 saying it is stopped", err)
	}
	if _, err := s.client.CreateSnapshot(ctx, "fork-3", agentapi.SnapshotSpec{VMID: "nope"}); statusOf(err) != http.StatusNotFound {
		t.Fatalf("snapshot of an unknown vm: %v, want 404", err)
	}
	if _, err := s.client.GetSnapshot(ctx, "fork-2"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("failed snapshot: GET %v, want 404", err)
	}
	// pause_source leaves the source paused.
	if _, err := s.client.CreateSnapshot(ctx, "fork-4", agentapi.SnapshotSpec{VMID: "src", PauseSource: true}); err != nil {
		t.Fatal(err)
	}
	if vm, _ := s.client.GetVM(ctx, "src"); vm.State != agentapi.StatePaused {
		t.Fatalf("source after pause_source snapshot = %+v, want paused", vm)
	}
	if dirs := s.snapshotDirs(t); len(dirs) != 2 {
		t.Fatalf("snapshot directories = %v, want fork-1 and fork-4 only", dirs)
	}

	// A crash left a partial snapshot: a restart removes it and keeps the
	// complete ones, which a retried PUT returns without a new snapshot.
	if err := os.MkdirAll(filepath.Join(dir, "snapshots", ".partial-fork-5-123"), 0o750); err != nil {
		t.Fatal(err)
	}
	s.srv.Close()
	s2 := startSnapAgent(t, dir)
	again, err := s2.client.CreateSnapshot(ctx, "fork-1", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil || again.SHA256 != first.SHA256 || !again.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("PUT after restart = %+v, %v; want the first snapshot %+v", again, err, first)
	}
	if c := s2.driver.snapshots.Load(); c != 0 {
		t.Fatalf("PUT after restart took %d new snapshots", c)
	}
	if dirs := s2.snapshotDirs(t); len(dirs) != 2 {
		t.Fatalf("snapshot directories after restart = %v, want fork-1 and fork-4", dirs)
	}
	// Every listed file is served as described; nothing else is.
	for _, f := range again.Files {
		body, _, err := s2.client.OpenSnapshotFile(ctx, "fork-1", f.Name)
		if err != nil {
			t.Fatalf("GET file %s: %v", f.Name, err)
		}
		b, err := io.ReadAll(body)
		_ = body.Close()
		sum := sha256.Sum256(b)
		if err != nil || int64(len(b)) != f.SizeBytes || hex.EncodeToString(sum[:]) != f.SHA256 {
			t.Fatalf("file %s: %d bytes, %v; want %+v", f.Name, len(b), err, f)
		}
	}
	for _, name := range []string{"snapshot.json", "../../vms/src/vm.json", "nope"} {
		if _, _, err := s2.client.OpenSnapshotFile(ctx, "fork-1", name); !errors.Is(err, agentapi.ErrNotFound) {
			t.Fatalf("GET file %q: %v, want 404", name, err)
		}
	}
}

func TestSpawnAndDeleteRules(t *testing.T) {
	s := startSnapAgent(t, t.TempDir())
	ctx := context.Background()
	if _, err := s.client.CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := s.client.CreateSnapshot(ctx, "snap", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatal(err)
	}
	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "snap"}
	vm, err := s.client.CreateVM(ctx, "child", child)
	if err != nil || vm.State != agentapi.StateRunning || vm.StartedFrom != agentapi.StartedSnapshot {
		t.Fatalf("child = %+v, %v; want running, started from snapshot", vm, err)
	}
	if again, err := s.client.CreateVM(ctx, "child", child); err != nil || !again.CreatedAt.Equal(vm.CreatedAt) {
		t.Fatalf("second PUT of the child = %+v, %v; want the same vm", again, err)
	}

	// Bad children start nothing and leave nothing.
	bad := []struct {
		name string
		spec agentapi.VMSpec
		code int
	}{
		{"other shape", func() agentapi.VMSpec { v := child; v.MemoryMiB *= 2; return v }(), http.StatusBadRequest},
		{"unknown snapshot", func() agentapi.VMSpec {
			v := child
			v.Snapshot = &agentapi.SnapshotSource{ID: "nope"}
			return v
		}(), http.StatusConflict},
		{"stopped", func() agentapi.VMSpec { v := child; v.Stopped = true; return v }(), http.StatusBadRequest},
	}
	for _, tc := range bad {
		if _, err := s.client.CreateVM(ctx, "bad", tc.spec); statusOf(err) != tc.code {
			t.Errorf("%s: %v, want %d", tc.name, err, tc.code)
		}
	}
	if _, err := s.client.GetVM(ctx, "bad"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("a refused child exists: %v", err)
	}
	if dirs := s.snapshotDirs(t); len(dirs) != 1 {
		t.Fatalf("snapshot directories = %v, want [snap]", dirs)
	}

	// The snapshot stays while a child uses it; the source does not count.
	err = s.client.DeleteSnapshot(ctx, "snap")
	if statusOf(err) != http.StatusConflict || !strings.Contains(err.Error(), "child") {
		t.Fatalf("delete of a snapshot in use: %v, want 409 naming the child", err)
	}
	if err := s.client.DeleteVM(ctx, "child"); err != nil {
		t.Fatal(err)
	}
	if err := s.client.DeleteSnapshot(ctx, "snap"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if dirs := s.snapshotDirs(t); len(dirs) != 0 {
		t.Fatalf("snapshot files left after delete: %v", dirs)
	}
	if err := s.client.DeleteSnapshot(ctx, "snap"); err != nil {
		t.Fatalf("second delete: %v, want 204", err)
	}
	if _, err := s.client.GetSnapshot(ctx, "snap"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("GET after delete: %v, want 404", err)
	}
	if _, err := s.client.CreateVM(ctx, "late", child); statusOf(err) != http.StatusConflict {
		t.Fatalf("child of a deleted snapshot: %v, want 409", err)
	}
}

// filesProxy stands between two agents: it counts the snapshot file
// requests and, when tamper is set, flips a byte of every file it serves.
type filesProxy struct {
	srv    *httptest.Server
	files  atomic.Int64
	tamper atomic.Bool
}

func startFilesProxy(t *testing.T, target string) *filesProxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p := &filesProxy{}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		if !strings.Contains(resp.Request.URL.Path, "/files/") || resp.StatusCode != http.StatusOK {
			return nil
		}
		p.files.Add(1)
		if !p.tamper.Load() {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return err
		}
		if len(b) > 0 {
			b[len(b)/2] ^= 0xff
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	p.srv = httptest.NewServer(rp)
	t.Cleanup(p.srv.Close)
	return p
}

func TestPullFromAnotherAgent(t *testing.T) {
	ctx := context.Background()
	a := startSnapAgent(t, t.TempDir())
	b := startSnapAgent(t, t.TempDir())
	proxy := startFilesProxy(t, a.srv.URL)

	// A fork of a fork: the second snapshot builds on the first, so a pull
	// of it brings both.
	if _, err := a.client.CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}
	parent, err := a.client.CreateSnapshot(ctx, "gen-1", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil {
		t.Fatal(err)
	}
	mid := spec
	mid.Snapshot = &agentapi.SnapshotSource{ID: "gen-1"}
	if _, err := a.client.CreateVM(ctx, "mid", mid); err != nil {
		t.Fatal(err)
	}
	snap, err := a.client.CreateSnapshot(ctx, "gen-2", agentapi.SnapshotSpec{VMID: "mid"})
	if err != nil {
		t.Fatal(err)
	}
	if snap.Parent != "gen-1" {
		t.Fatalf("snapshot of a child: parent %q, want gen-1", snap.Parent)
	}
	child := spec
	// The control plane gives the source's pinned key; the source proves
	// it for the address of the proxy in front of it.
	if err := a.agent.AllowAddress(proxy.srv.URL); err != nil {
		t.Fatal(err)
	}
	child.Snapshot = &agentapi.SnapshotSource{ID: "gen-2", Address: proxy.srv.URL, PublicKey: agentapi.EncodeKey(a.agent.PublicKey())}

	// A tampered transfer is rejected: no child, no snapshot, no leftovers.
	proxy.tamper.Store(true)
	_, err = b.client.CreateVM(ctx, "child-0", child)
	if err == nil || !strings.Contains(err.Error(), "sha256") {
		t.Fatalf("child from a tampered pull: %v, want a sha256 mismatch", err)
	}
	if vms, _ := b.client.ListVMs(ctx); len(vms) != 0 {
		t.Fatalf("a tampered pull left vms %+v", vms)
	}
	if dirs := b.snapshotDirs(t); len(dirs) != 0 {
		t.Fatalf("a tampered pull left snapshot directories %v", dirs)
	}
	if dirs := b.vmDirs(t); len(dirs) != 0 {
		t.Fatalf("a tampered pull left vm directories %v", dirs)
	}

	// Four children at once on b: one pull of each file.
	proxy.tamper.Store(false)
	proxy.files.Store(0)
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vm, err := b.client.CreateVM(ctx, fmt.Sprintf("child-%d", i), child)
			if err != nil || vm.StartedFrom != agentapi.StartedSnapshot {
				t.Errorf("child %d on b: %+v, %v", i, vm, err)
			}
		}()
	}
	wg.Wait()
	want := int64(len(snap.Files) + len(parent.Files))
	if got := proxy.files.Load(); got != want {
		t.Fatalf("file requests for 4 children = %d, want %d (one pull of gen-1 and gen-2)", got, want)
	}
	for _, id := range []string{"gen-1", "gen-2"} {
		local, err := b.client.GetSnapshot(ctx, id)
		remote, _ := a.client.GetSnapshot(ctx, id)
		if err != nil || local.SHA256 != remote.SHA256 {
			t.Fatalf("pulled snapshot %s = %+v, %v; want the source's %+v", id, local, err, remote)
		}
	}
	// gen-1 is needed by gen-2, gen-2 by the children.
	if err := b.client.DeleteSnapshot(ctx, "gen-1"); statusOf(err) != http.StatusConflict {
		t.Fatalf("delete of a parent snapshot: %v, want 409", err)
	}
}

// TestUnsyncedSnapshotAfterHostStop: snapshot files are synced after the
// snapshot is answered. A start that finds a snapshot still flagged
// unsynced (the host stopped in that window) checks its files: intact ones
// are kept and synced, a torn one is reported corrupt and only deletable.
func TestUnsyncedSnapshotAfterHostStop(t *testing.T) {
	dir := t.TempDir()
	s := startSnapAgent(t, dir)
	ctx := context.Background()
	if _, err := s.client.CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}
	snaps := map[string]agentapi.Snapshot{}
	for _, id := range []string{"intact", "torn"} {
		snap, err := s.client.CreateSnapshot(ctx, id, agentapi.SnapshotSpec{VMID: "src"})
		if err != nil {
			t.Fatal(err)
		}
		snaps[id] = snap
	}
	s.srv.Close()
	if err := s.agent.Close(); err != nil { // waits for the background syncs
		t.Fatal(err)
	}
	meta := func(id string) map[string]any {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, "snapshots", id, "snapshot.json"))
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	for id := range snaps {
		if m := meta(id); m["unsynced"] != nil {
			t.Fatalf("snapshot %s after the agent closed: unsynced = %v, want the flag cleared", id, m["unsynced"])
		}
	}

	// The host stops before the syncs: both flagged, one file torn.
	for id := range snaps {
		m := meta(id)
		m["unsynced"] = true
		b, _ := json.Marshal(m)
		if err := os.WriteFile(filepath.Join(dir, "snapshots", id, "snapshot.json"), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	torn := filepath.Join(dir, "snapshots", "torn", snaps["torn"].Files[0].Name)
	if err := os.WriteFile(torn, []byte("zeros where the state was"), 0o600); err != nil {
		t.Fatal(err)
	}

	s2 := startSnapAgent(t, dir)
	if got, err := s2.client.GetSnapshot(ctx, "intact"); err != nil || got.SHA256 != snaps["intact"].SHA256 {
		t.Fatalf("intact unsynced snapshot after restart = %+v, %v", got, err)
	}
	if m := meta("intact"); m["unsynced"] != nil {
		t.Fatalf("intact snapshot after the check: unsynced = %v, want the flag cleared", m["unsynced"])
	}
	if _, err := s2.client.GetSnapshot(ctx, "torn"); statusOf(err) != http.StatusConflict || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("torn snapshot after restart: %v, want 409 saying its file does not match", err)
	}
	spawn := spec
	spawn.Snapshot = &agentapi.SnapshotSource{ID: "torn"}
	if _, err := s2.client.CreateVM(ctx, "child", spawn); err == nil {
		t.Fatal("a child started from a torn snapshot")
	}
	if err := s2.client.DeleteSnapshot(ctx, "torn"); err != nil {
		t.Fatalf("delete the torn snapshot: %v", err)
	}
}
