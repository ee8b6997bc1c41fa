package qemu_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// forkAgent is an agent built here rather than by testenv, so that the test
// can read its driver's pause counter.
type forkAgent struct {
	dir    string
	driver *qemu.Driver
	ag     *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
}

func startForkAgent(t *testing.T, dir string) *forkAgent {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: testenv.Accel(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	f := &forkAgent{dir: dir, driver: d, ag: a, srv: httptest.NewServer(a.Handler())}
	f.client = agentapi.NewClient(f.srv.URL, "agent-token")
	t.Cleanup(func() {
		f.stop()
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return f
}

func (f *forkAgent) stop() {
	f.srv.Close()
	_ = f.ag.Close()
}

func (f *forkAgent) console(t *testing.T, id string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.dir, "vms", id, "console.log"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return string(b)
}

var tickLine = regexp.MustCompile(`(?m)^tick ([0-9]+)\r?$`)

// ticks returns the tick numbers on a console, in order.
func ticks(con string) []int {
	var out []int
	for _, m := range tickLine.FindAllStringSubmatch(con, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

// waitTicks waits until vm id has printed at least n tick lines.
func (f *forkAgent) waitTicks(t *testing.T, id string, n int) []int {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		con := f.console(t, id)
		if ts := ticks(con); len(ts) >= n {
			return ts
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: fewer than %d tick lines within %s; console:\n%s", id, n, bootWait, con)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// generationID asks a VM's QEMU for its vmgenid over QMP.
func generationID(t *testing.T, dir, id string) string {
	t.Helper()
	conn, err := net.DialTimeout("unix", filepath.Join(dir, "vms", id, "qmp.sock"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(conn)
	var out struct {
		Return struct {
			GUID string `json:"guid"`
		} `json:"return"`
	}
	for _, cmd := range []string{"", `{"execute":"qmp_capabilities"}`, `{"execute":"query-vm-generation-id"}`} {
		if cmd != "" {
			if _, err := conn.Write([]byte(cmd + "\n")); err != nil {
				t.Fatal(err)
			}
		}
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				t.Fatalf("qmp of %s: %v", id, err)
			}
			if !bytes.Contains(line, []byte(`"event"`)) {
				_ = json.Unmarshal(line, &out)
				break
			}
		}
	}
	return out.Return.GUID
}

// tamperProxy forwards to an agent; with tamper set it flips one byte of
// every snapshot file it serves, or with only set, of that file alone, and
// with hold set it calls hold before it sends a tampered file.
type tamperProxy struct {
	srv    *httptest.Server
	tamper atomic.Bool
	only   atomic.Pointer[string]
	hold   atomic.Pointer[func()]
}

func startTamperProxy(t *testing.T, target string) *tamperProxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p := &tamperProxy{}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		if !p.tamper.Load() || !strings.Contains(resp.Request.URL.Path, "/files/") || resp.StatusCode != http.StatusOK {
			return nil
		}
		if only := p.only.Load(); only != nil && !strings.HasSuffix(resp.Request.URL.Path, "/files/"+*only) {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return err
		}
		b[len(b)/3] ^= 0x01
		if hold := p.hold.Load(); hold != nil {
			(*hold)()
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	p.srv = httptest.NewServer(rp)
	t.Cleanup(p.srv.Close)
	return p
}

// TestForkGuest forks a guest that counts: every child continues from the
// snapshot's tick, on this agent and on another one, and the source goes on.
func TestForkGuest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := startForkAgent(t, t.TempDir())
	if _, err := a.client.CreateVM(ctx, "src", guest); err != nil {
		t.Fatalf("create source: %v", err)
	}
	a.waitTicks(t, "src", 2)

	// The snapshot keeps the source paused, so that its last tick is the
	// snapshot point.
	snap, err := a.client.CreateSnapshot(ctx, "s1", agentapi.SnapshotSpec{VMID: "src", PauseSource: true})
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if a.driver.SnapshotPauses() != 1 {
		t.Fatalf("pauses after one snapshot = %d", a.driver.SnapshotPauses())
	}
	if vm, _ := a.client.GetVM(ctx, "src"); vm.State != agentapi.StatePaused {
		t.Fatalf("source after a pause_source snapshot = %+v, want paused", vm)
	}
	srcTicks := ticks(a.console(t, "src"))
	point := srcTicks[len(srcTicks)-1]
	// The source's RAM is a memfd: it goes to a RAM image of its own, and
	// the migration stream holds only the device state.
	if f := snapshotFiles(snap); f[agentapi.SnapshotFileMemory].SizeBytes > 8<<20 ||
		f[agentapi.SnapshotFileRAM].SizeBytes != guest.MemoryMiB<<20 || f[agentapi.SnapshotFileDisk].Name == "" {
		t.Fatalf("snapshot files = %+v; want a small device state, a RAM image and a disk", snap.Files)
	}
	again, err := a.client.CreateSnapshot(ctx, "s1", agentapi.SnapshotSpec{VMID: "src", PauseSource: true})
	if err != nil || again.SHA256 != snap.SHA256 || a.driver.SnapshotPauses() != 1 {
		t.Fatalf("second PUT = %+v, %v, pauses %d; want the same snapshot and no new pause", again, err, a.driver.SnapshotPauses())
	}

	// Three children at once.
	child := guest
	child.Snapshot = &agentapi.SnapshotSource{ID: "s1"}
	children := []string{"c0", "c1", "c2"}
	spawnChildren(ctx, t, a.client, child, children)
	if _, err := a.client.Action(ctx, "src", agentapi.ActionResume); err != nil {
		t.Fatalf("resume source: %v", err)
	}
	t.Logf("snapshot taken after tick %d: %d bytes in %d files", point, snap.SizeBytes, len(snap.Files))
	genids := map[string]string{"src": generationID(t, a.dir, "src")}
	for _, id := range children {
		ts := a.waitTicks(t, id, 1)
		if ts[0] != point+1 {
			t.Errorf("child %s starts at tick %d; the snapshot was taken after tick %d", id, ts[0], point)
		}
		if con := a.console(t, id); strings.Contains(con, "kvm-guest-ready") {
			t.Errorf("child %s booted instead of continuing the snapshot:\n%s", id, con)
		}
		genids[id] = generationID(t, a.dir, id)
	}
	if ts := a.waitTicks(t, "src", len(srcTicks)+1); ts[len(srcTicks)] != point+1 {
		t.Errorf("source continues with tick %d after tick %d", ts[len(srcTicks)], point)
	}
	seen := map[string]string{}
	for id, g := range genids {
		if g == "" || seen[g] != "" {
			t.Errorf("vmgenid of %s = %q, the same as %s's: children need a new one", id, g, seen[g])
		}
		seen[g] = id
	}

	// A child's RAM is a private mapping of the RAM image, not a memfd: its
	// snapshot carries its RAM in the migration stream, and a grandchild
	// continues from that one.
	sc, err := a.client.CreateSnapshot(ctx, "s1-c1", agentapi.SnapshotSpec{VMID: "c1", PauseSource: true})
	if err != nil {
		t.Fatalf("snapshot of a child: %v", err)
	}
	if f := snapshotFiles(sc); f[agentapi.SnapshotFileRAM].Name != "" || f[agentapi.SnapshotFileMemory].SizeBytes < 8<<20 {
		t.Fatalf("snapshot of a child: files %+v; want its RAM in the memory stream", sc.Files)
	}
	c1Ticks := ticks(a.console(t, "c1"))
	grand := guest
	grand.Snapshot = &agentapi.SnapshotSource{ID: "s1-c1"}
	spawnChildren(ctx, t, a.client, grand, []string{"g0"})
	if ts := a.waitTicks(t, "g0", 1); ts[0] != c1Ticks[len(c1Ticks)-1]+1 {
		t.Errorf("grandchild starts at tick %d; its snapshot was taken after tick %d", ts[0], c1Ticks[len(c1Ticks)-1])
	}
	if _, err := a.client.Action(ctx, "c1", agentapi.ActionResume); err != nil {
		t.Fatalf("resume child: %v", err)
	}

	// A child on another agent pulls the snapshot; a tampered pull starts
	// nothing and leaves nothing.
	b := startForkAgent(t, t.TempDir())
	proxy := startTamperProxy(t, a.srv.URL)
	remote := guest
	if err := a.ag.AllowAddress(proxy.srv.URL); err != nil {
		t.Fatal(err)
	}
	remote.Snapshot = &agentapi.SnapshotSource{ID: "s1", Address: proxy.srv.URL, PublicKey: agentapi.EncodeKey(a.ag.PublicKey())}
	proxy.tamper.Store(true)
	if _, err := b.client.CreateVM(ctx, "far", remote); err == nil || !strings.Contains(err.Error(), "sha256") {
		t.Fatalf("child from a tampered pull: %v, want a sha256 mismatch", err)
	}
	if pids := qemu.ProcessesUnder(b.dir); len(pids) != 0 {
		t.Fatalf("a tampered pull started qemu %v", pids)
	}
	for _, sub := range []string{"vms", "snapshots"} {
		if entries, _ := os.ReadDir(filepath.Join(b.dir, sub)); len(entries) != 0 {
			t.Fatalf("a tampered pull left %s/%s", sub, entries[0].Name())
		}
	}
	// The child's QEMU starts once the disk files are in: a device state
	// or RAM image tampered with after that ends it before it loads
	// anything, and leaves nothing either.
	for _, name := range []string{"memory.state", "memory.ram"} {
		proxy.only.Store(&name)
		early := b.driver.EarlyStarts()
		// The tampered file arrives once the child's QEMU began to start
		// (the RAM image streams beside the disk chain, so it could come
		// first otherwise).
		hold := func() {
			for deadline := time.Now().Add(30 * time.Second); b.driver.EarlyStarts() == early && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
		}
		proxy.hold.Store(&hold)
		if _, err := b.client.CreateVM(ctx, "far", remote); err == nil || !strings.Contains(err.Error(), "file "+name) {
			t.Fatalf("child from a pull with %s tampered: %v, want that file rejected", name, err)
		}
		// The client retries a failed pull (a 502): one early start each.
		if b.driver.EarlyStarts() == early {
			t.Fatalf("child from a pull with %s tampered: no early start, want its qemu started before the file came", name)
		}
		if pids := qemu.ProcessesUnder(b.dir); len(pids) != 0 {
			t.Fatalf("a pull with %s tampered left qemu %v", name, pids)
		}
		for _, sub := range []string{"vms", "snapshots"} {
			if entries, _ := os.ReadDir(filepath.Join(b.dir, sub)); len(entries) != 0 {
				t.Fatalf("a pull with %s tampered left %s/%s", name, sub, entries[0].Name())
			}
		}
	}
	proxy.only.Store(nil)
	proxy.hold.Store(nil)
	proxy.tamper.Store(false)
	early := b.driver.EarlyStarts()
	if vm, err := b.client.CreateVM(ctx, "far", remote); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("child on another agent = %+v, %v", vm, err)
	}
	if ts := b.waitTicks(t, "far", 1); ts[0] != point+1 {
		t.Errorf("child on another agent starts at tick %d; the snapshot was taken after tick %d", ts[0], point)
	}
	if b.driver.EarlyStarts() != early+1 {
		t.Errorf("child on another agent: %d early starts, want 1 (its qemu starts while the ram image arrives)", b.driver.EarlyStarts()-early)
	}
	// A child started while its snapshot was pulled (its QEMU opened the
	// frozen disk in the pull directory) is a VM like any other: it can be
	// snapshotted and forked in turn.
	if _, err := b.client.CreateSnapshot(ctx, "far-s", agentapi.SnapshotSpec{VMID: "far"}); err != nil {
		t.Fatalf("snapshot of the child on another agent: %v", err)
	}
	farChild := guest
	farChild.Snapshot = &agentapi.SnapshotSource{ID: "far-s"}
	spawnChildren(ctx, t, b.client, farChild, []string{"far-c"})
	b.waitTicks(t, "far-c", 1)

	// Without pause_source the source goes on by itself.
	if _, err := a.client.CreateSnapshot(ctx, "s2", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("second snapshot: %v", err)
	}
	if vm, _ := a.client.GetVM(ctx, "src"); vm.State != agentapi.StateRunning || a.driver.SnapshotPauses() != 3 {
		t.Fatalf("source after a snapshot = %+v, pauses %d; want running, 3 (s1, s1-c1, s2)", vm, a.driver.SnapshotPauses())
	}
	n := len(ticks(a.console(t, "src")))
	a.waitTicks(t, "src", n+2)

	// Two children of one snapshot on another agent: one pulls it, the
	// other waits for that pull; each starts early or after it.
	two := guest
	two.Snapshot = &agentapi.SnapshotSource{ID: "s2", Address: proxy.srv.URL, PublicKey: agentapi.EncodeKey(a.ag.PublicKey())}
	early = b.driver.EarlyStarts()
	spawnChildren(ctx, t, b.client, two, []string{"far2a", "far2b"})
	if n := b.driver.EarlyStarts() - early; n < 1 || n > 2 {
		t.Errorf("two children on another agent: %d early starts, want 1 or 2", n)
	}
	b.waitTicks(t, "far2a", 1)
	b.waitTicks(t, "far2b", 1)

	// A restart keeps snapshots and children; a child is a normal VM: a
	// start after a stop boots it from its own disk.
	a.stop()
	a2 := startForkAgent(t, a.dir)
	if got, err := a2.client.GetSnapshot(ctx, "s1"); err != nil || got.SHA256 != snap.SHA256 {
		t.Fatalf("snapshot after restart = %+v, %v", got, err)
	}
	for _, id := range children {
		if vm, err := a2.client.GetVM(ctx, id); err != nil || vm.State != agentapi.StateRunning {
			t.Fatalf("child %s after restart = %+v, %v", id, vm, err)
		}
	}
	if _, err := a2.client.Action(ctx, "c0", agentapi.ActionStop); err != nil {
		t.Fatalf("stop child: %v", err)
	}
	if vm, err := a2.client.Action(ctx, "c0", agentapi.ActionStart); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("start child = %+v, %v", vm, err)
	}
	waitConsoleFile(t, a2, "c0", "(?m)^disk vda 67108864\r?$", 1)

	// Delete: refused while children use the snapshot, then the files go.
	if err := a2.client.DeleteSnapshot(ctx, "s1"); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("delete of a snapshot with children: %v, want 409", err)
	}
	for _, id := range append([]string{"g0"}, children...) {
		if err := a2.client.DeleteVM(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"s1-c1", "s1", "s2"} {
		if err := a2.client.DeleteSnapshot(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
		if _, err := os.Stat(filepath.Join(a2.dir, "snapshots", id)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("files of snapshot %s after delete: %v", id, err)
		}
	}
	// The source's disk chain does not need the snapshots: it still boots.
	if _, err := a2.client.Action(ctx, "src", agentapi.ActionStop); err != nil {
		t.Fatalf("stop source: %v", err)
	}
	if vm, err := a2.client.Action(ctx, "src", agentapi.ActionStart); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("start source = %+v, %v", vm, err)
	}
	waitConsoleFile(t, a2, "src", "(?m)^disk vda 67108864\r?$", 2) // the first boot's, then this one's
}

// snapshotFiles is a snapshot's files by kind (one of each here).
func snapshotFiles(s agentapi.Snapshot) map[string]agentapi.SnapshotFile {
	out := map[string]agentapi.SnapshotFile{}
	for _, f := range s.Files {
		out[f.Kind] = f
	}
	return out
}

// waitConsoleFile waits until pattern appears n times on vm id's console.
func waitConsoleFile(t *testing.T, f *forkAgent, id, pattern string, n int) {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(bootWait)
	for len(re.FindAllString(f.console(t, id), -1)) < n {
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: no %q on its console within %s:\n%s", id, pattern, bootWait, f.console(t, id))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// spawnChildren creates the children from spec at once and stops the test
// unless each runs, started from the snapshot.
func spawnChildren(ctx context.Context, t *testing.T, c *agentapi.Client, spec agentapi.VMSpec, ids []string) {
	t.Helper()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() {
			vm, err := c.CreateVM(ctx, id, spec)
			if err != nil || vm.State != agentapi.StateRunning || vm.StartedFrom != agentapi.StartedSnapshot {
				t.Errorf("child %s = %+v, %v", id, vm, err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
}

// TestSnapshotAndSpawnQMPSessions counts the QMP connections that one
// snapshot (with the agent's state checks before and after it) and one
// child's start open: one session per operation, however long the guest
// stays paused.
func TestSnapshotAndSpawnQMPSessions(t *testing.T) {
	ctx := context.Background()
	a := startForkAgent(t, t.TempDir())
	if _, err := a.client.CreateVM(ctx, "src", guest); err != nil {
		t.Fatalf("create source: %v", err)
	}
	a.waitTicks(t, "src", 1)
	before := a.driver.QMPSessions()
	if _, err := a.client.CreateSnapshot(ctx, "s1", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	snapshot := a.driver.QMPSessions() - before
	child := guest
	child.Snapshot = &agentapi.SnapshotSource{ID: "s1"}
	before = a.driver.QMPSessions()
	spawnChildren(ctx, t, a.client, child, []string{"c0"})
	spawn := a.driver.QMPSessions() - before
	t.Logf("qmp sessions: snapshot %d (with the agent's state check before and after), child start %d", snapshot, spawn)
	if snapshot != 3 || spawn != 1 {
		t.Errorf("qmp sessions: snapshot %d, child start %d; want 3 (check, snapshot, check) and 1", snapshot, spawn)
	}
}

// TestRepeatedSnapshotsKeepAChildRunning snapshots a child (its RAM is not
// a memfd, so the VM is continued right after its state is saved) again and
// again: every snapshot must leave it running, and the next one must not
// find it marked paused by the last one's migration.
func TestRepeatedSnapshotsKeepAChildRunning(t *testing.T) {
	ctx := context.Background()
	a := startForkAgent(t, t.TempDir())
	spec := guest
	spec.DiskMiB = 0
	if _, err := a.client.CreateVM(ctx, "src", spec); err != nil {
		t.Fatalf("create source: %v", err)
	}
	a.waitTicks(t, "src", 1)
	if _, err := a.client.CreateSnapshot(ctx, "base", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("snapshot of the source: %v", err)
	}
	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "base"}
	spawnChildren(ctx, t, a.client, child, []string{"c"})
	for i := range 20 {
		id := "c-" + strconv.Itoa(i)
		if _, err := a.client.CreateSnapshot(ctx, id, agentapi.SnapshotSpec{VMID: "c"}); err != nil {
			t.Fatalf("snapshot %d of the child: %v", i, err)
		}
		if vm, err := a.client.GetVM(ctx, "c"); err != nil || vm.State != agentapi.StateRunning {
			t.Fatalf("child after snapshot %d = %+v, %v; want running", i, vm, err)
		}
	}
}
