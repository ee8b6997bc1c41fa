package qemu_test

import (
	"context"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func startHuskAgent(t *testing.T, dir string, husks int) *forkAgent {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: "auto", Logger: log, Husks: husks})
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

// readyHusks lists the husk directories (not yet handed out) whose QEMU
// waits for a snapshot.
func readyHusks(t *testing.T, dir string) []string {
	t.Helper()
	entries, _ := os.ReadDir(filepath.Join(dir, "husks"))
	var out []string
	for _, e := range entries {
		p := filepath.Join(dir, "husks", e.Name())
		if fi, err := os.Lstat(p); err != nil || !fi.IsDir() {
			continue
		}
		if len(qemu.ProcessesOf(p)) == 1 {
			if _, err := os.Stat(filepath.Join(p, "qmp.sock")); err == nil && qmpRunState(t, filepath.Join(p, "qmp.sock")) == "inmigrate" {
				out = append(out, p)
			}
		}
	}
	return out
}

func waitHusks(t *testing.T, dir string, n int) []string {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		if hs := readyHusks(t, dir); len(hs) >= n {
			return hs
		}
		if time.Now().After(deadline) {
			t.Fatalf("fewer than %d ready husks in %s within %s", n, dir, bootWait)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// huskChildren maps the husks handed out (symlinks in husks/) to the VM
// directory each now is.
func huskChildren(t *testing.T, dir string) map[string]string {
	t.Helper()
	entries, _ := os.ReadDir(filepath.Join(dir, "husks"))
	out := map[string]string{}
	for _, e := range entries {
		p := filepath.Join(dir, "husks", e.Name())
		if fi, err := os.Lstat(p); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			if target, err := filepath.EvalSymlinks(p); err == nil {
				out[p] = filepath.Base(target)
			}
		}
	}
	return out
}

func TestForkIntoHusks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	a := startHuskAgent(t, dir, 2)
	if _, err := a.client.CreateVM(ctx, "src", guest); err != nil {
		t.Fatalf("create source: %v", err)
	}
	a.waitTicks(t, "src", 2)
	if _, err := a.client.CreateSnapshot(ctx, "s1", agentapi.SnapshotSpec{VMID: "src", PauseSource: true}); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	srcTicks := ticks(a.console(t, "src"))
	point := srcTicks[len(srcTicks)-1]
	// The snapshot asked for husks of the source's shape.
	husks := waitHusks(t, dir, 2)
	var husksPIDs []int
	for _, h := range husks {
		husksPIDs = append(husksPIDs, qemu.ProcessesOf(h)...)
	}

	child := guest
	child.Snapshot = &agentapi.SnapshotSource{ID: "s1"}
	children := []string{"c0", "c1", "c2"}
	spawnChildren(ctx, t, a.client, child, children)
	// Each ready husk went to one child, never two.
	handed := huskChildren(t, dir)
	byChild := map[string]string{}
	for h, vm := range handed {
		if byChild[vm] != "" {
			t.Fatalf("vm %s got two husks: %s and %s", vm, byChild[vm], h)
		}
		byChild[vm] = h
	}
	for _, h := range husks {
		if handed[h] == "" || !slices.Contains(children, handed[h]) {
			t.Fatalf("husk %s was not handed to a child: %v", h, handed)
		}
	}
	genids := map[string]string{}
	for _, id := range children {
		ts := a.waitTicks(t, id, 1)
		if ts[0] != point+1 {
			t.Errorf("child %s starts at tick %d; the snapshot was taken after tick %d", id, ts[0], point)
		}
		g := generationID(t, dir, id)
		for other, og := range genids {
			if g == "" || g == og {
				t.Errorf("child %s has vmgenid %q, like %s", id, g, other)
			}
		}
		genids[id] = g
	}
	// A child from a husk is a normal VM: it writes its own disk, which
	// boots after a stop (the overlay names the frozen disk), and its
	// delete ends its QEMU.
	var hc string
	for _, id := range children {
		if byChild[id] != "" {
			hc = id
			break
		}
	}
	if _, err := a.client.Action(ctx, hc, agentapi.ActionStop); err != nil {
		t.Fatalf("stop child %s: %v", hc, err)
	}
	if vm, err := a.client.Action(ctx, hc, agentapi.ActionStart); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("start child %s = %+v, %v", hc, vm, err)
	}
	waitConsoleFile(t, a, hc, "(?m)^disk vda 67108864\r?$", 1)
	for _, id := range children {
		if err := a.client.DeleteVM(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	for _, pid := range husksPIDs {
		if pidAlive(pid) {
			t.Errorf("qemu %d of a husk child still runs after its vm was deleted", pid)
		}
	}

	// An agent that dies leaves its ready husks; the next one kills them
	// when it first needs husks.
	waitHusks(t, dir, 2)
	left := qemu.ProcessesUnder(filepath.Join(dir, "husks"))
	a.srv.Close() // no Close: as if the agent died
	a2 := startHuskAgent(t, dir, 1)
	if _, err := a2.client.Action(ctx, "src", agentapi.ActionResume); err != nil {
		t.Fatalf("resume source: %v", err)
	}
	if _, err := a2.client.CreateSnapshot(ctx, "s2", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatalf("snapshot after restart: %v", err)
	}
	for _, pid := range left {
		if pidAlive(pid) {
			t.Errorf("husk qemu %d of the previous agent still runs", pid)
		}
	}
	// Close ends the husks that were never handed out.
	waitHusks(t, dir, 1)
	a2.stop()
	if pids := qemu.ProcessesUnder(filepath.Join(dir, "husks")); len(pids) != 0 {
		t.Errorf("husk processes %v run after the agent closed", pids)
	}
	a.stop()
}
