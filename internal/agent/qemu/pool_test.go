package qemu_test

// The warm pool with real guests (docs/guides/architecture.md, the rules about
// processes): a warm create resumes a paused guest that keeps running;
// delete destroys and the pool gets a brand-new VM; a restart destroys the
// orphans and never a user's VM; a warm VM that cannot resume falls back to
// a cold boot. Bookkeeping rules are in internal/agent/pool_test.go (sim).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const poolToken = "pool-token"

type qemuPool struct {
	dir    string
	agent  *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
}

// poolStateDir is a state directory whose QEMU processes, warm or handed
// out, are all killed when the test ends, whatever happened.
func poolStateDir(t *testing.T) string {
	dir := t.TempDir()
	t.Cleanup(func() {
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return dir
}

// startQEMUPool starts an agent with the qemu driver on dir, as a new
// process would: a new driver, the same state directory.
func startQEMUPool(t *testing.T, dir string) *qemuPool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: testenv.Accel(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: poolToken, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	h := &qemuPool{dir: dir, agent: a, srv: httptest.NewServer(a.Handler())}
	h.client = agentapi.NewClient(h.srv.URL, poolToken)
	t.Cleanup(h.stop)
	return h
}

// stop stops the agent; its VMs, warm ones included, keep running.
func (h *qemuPool) stop() {
	h.srv.Close()
	_ = h.agent.Close()
}

func (h *qemuPool) setPool(t *testing.T, size int) {
	t.Helper()
	_, err := h.client.SetPool(context.Background(), guest.Image, agentapi.PoolPut{Shapes: []agentapi.PoolShape{
		{VCPUs: guest.VCPUs, MemoryMiB: guest.MemoryMiB, DiskMiB: guest.DiskMiB, Size: size}}})
	if err != nil {
		t.Fatalf("PUT /v1/pool/%s: %v", guest.Image, err)
	}
}

// waitReady waits until n warm VMs are ready and none boots, in the status
// and in the registry (written just after), and returns their ids.
func (h *qemuPool) waitReady(t *testing.T, n int) []string {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		items, err := h.client.Pool(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		ids := h.registryReady(t)
		if len(items) == 1 && items[0].Ready == n && items[0].Booting == 0 && len(ids) == n {
			return ids
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %+v, registry %v: not %d ready warm vms within %s", items, ids, n, bootWait)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// registryReady lists the ready warm VMs of pool.json.
func (h *qemuPool) registryReady(t *testing.T) []string {
	t.Helper()
	var reg struct {
		Entries []struct {
			ID    string `json:"id"`
			State string `json:"state"`
		} `json:"entries"`
	}
	b, err := os.ReadFile(filepath.Join(h.dir, "pool.json"))
	if err == nil {
		err = json.Unmarshal(b, &reg)
	}
	if err != nil {
		t.Fatalf("pool.json: %v", err)
	}
	var ids []string
	for _, e := range reg.Entries {
		if e.State == "ready" {
			ids = append(ids, e.ID)
		}
	}
	return ids
}

func (h *qemuPool) warmDir(id string) string { return filepath.Join(h.dir, "pool", id) }

// onePID returns the one QEMU process of the VM directory dir.
func onePID(t *testing.T, dir string) int {
	t.Helper()
	pids := qemu.ProcessesOf(dir)
	if len(pids) != 1 {
		t.Fatalf("qemu processes of %s: %v, want one", dir, pids)
	}
	return pids[0]
}

// qmpRunState asks the QEMU behind a QMP socket for its run state.
func qmpRunState(t *testing.T, sock string) string {
	t.Helper()
	conn, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", sock, err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(conn)
	read := func() map[string]json.RawMessage {
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				t.Fatalf("qmp %s: %v", sock, err)
			}
			var m map[string]json.RawMessage
			if json.Unmarshal(line, &m) == nil && m["event"] == nil {
				return m
			}
		}
	}
	read() // greeting
	for _, cmd := range []string{"qmp_capabilities", "query-status"} {
		if _, err := fmt.Fprintf(conn, `{"execute":%q}`, cmd); err != nil {
			t.Fatal(err)
		}
		m := read()
		if cmd == "query-status" {
			var st struct {
				Status string `json:"status"`
			}
			if err := json.Unmarshal(m["return"], &st); err != nil {
				t.Fatalf("query-status: %s", m["return"])
			}
			return st.Status
		}
	}
	return ""
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// niceOf is the nice value of every thread of a process (field 19 of
// /proc/<pid>/task/<tid>/stat), when they all have the same; it fails the
// test when they differ: a thread left at another priority is the race a
// setpriority after the start would have.
func niceOf(t *testing.T, pid int) int {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	nices := map[int][]string{}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		s := string(b)
		n, err := strconv.Atoi(strings.Fields(s[strings.LastIndexByte(s, ')')+1:])[16])
		if err != nil {
			t.Fatalf("%s: nice: %v", b, err)
		}
		nices[n] = append(nices[n], task.Name())
	}
	if len(nices) != 1 {
		t.Fatalf("the threads of process %d run at different nice values: %v", pid, nices)
	}
	for n := range nices {
		return n
	}
	return 0
}

// exits tells whether a killed process is gone within 10 seconds: the
// kernel tears a process down after the kill returns (its command line
// empties before it becomes a zombie), so a check right away may still see
// it.
func exits(pid int) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if !pidAlive(pid) {
			return true
		}
	}
	return false
}

var poolTickLine = regexp.MustCompile(`(?m)^tick (\d+)\r?$`)

// lastTick is the highest tick on a console, -1 for none.
func lastTick(console string) int {
	last := -1
	for _, m := range poolTickLine.FindAllStringSubmatch(console, -1) {
		if n, _ := strconv.Atoi(m[1]); n > last {
			last = n
		}
	}
	return last
}

// waitTick waits until the console of vm id shows tick n.
func (h *qemuPool) waitTick(t *testing.T, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		con, err := h.client.Console(context.Background(), id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if lastTick(con) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: no tick %d within %s; console:\n%s", id, n, bootWait, con)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestWarmCreateResumesThePausedGuest(t *testing.T) {
	t.Parallel()
	h := startQEMUPool(t, poolStateDir(t))
	ctx := context.Background()
	h.setPool(t, 1)
	w := h.waitReady(t, 1)[0]
	wdir := h.warmDir(w)
	pid := onePID(t, wdir)
	if st := qmpRunState(t, filepath.Join(wdir, "qmp.sock")); st != "paused" {
		t.Fatalf("ready warm vm %s is %q, want paused", w, st)
	}
	if n := niceOf(t, pid); n != 10 {
		t.Fatalf("warm vm %s runs at nice %d, want 10 (below user vms)", w, n)
	}
	if cg := cgroupWeightNice(t, pid); cg != "" && cg != "10" {
		t.Fatalf("warm vm %s: its cgroup's cpu.weight.nice = %s, want 10", w, cg)
	}
	con, err := os.ReadFile(filepath.Join(wdir, "console.log"))
	if err != nil || !strings.Contains(string(con), "kvm-guest-ready") {
		t.Fatalf("warm vm paused before its ready line: %q, %v", con, err)
	}
	disk := inode(t, filepath.Join(wdir, "disk.qcow2"))

	vm, err := h.client.CreateVM(ctx, "hot", guest)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm || vm.State != agentapi.StateRunning || vm.PID != pid {
		t.Fatalf("create hot = %+v, %v; want running, warm, pid %d", vm, err, pid)
	}
	vdir := filepath.Join(h.dir, "vms", "hot")
	if st := qmpRunState(t, filepath.Join(vdir, "qmp.sock")); st != "running" {
		t.Fatalf("vm hot reported running, qemu says %q", st)
	}
	if n := niceOf(t, pid); n != qemu.DefaultNice {
		t.Fatalf("vm hot runs at nice %d after the handover, want the user vms' %d", n, qemu.DefaultNice)
	}
	if cg := cgroupWeightNice(t, pid); cg != "" && cg != strconv.Itoa(qemu.DefaultNice) {
		t.Fatalf("vm hot: its cgroup's cpu.weight.nice = %s after the handover, want %d", cg, qemu.DefaultNice)
	}
	// Its process, disk and console are the new VM's.
	if got := inode(t, filepath.Join(vdir, "disk.qcow2")); got != disk {
		t.Fatalf("vm hot's disk is inode %d, want the warm vm's own overlay %d", got, disk)
	}
	if got, err := h.client.GetVM(ctx, "hot"); err != nil || got.State != agentapi.StateRunning || got.PID != pid || got.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("GET hot = %+v, %v", got, err)
	}
	// The guest goes on where it paused: its ticks continue.
	h.waitTick(t, "hot", lastTick(string(con))+2)
}

func TestDeleteNeverReturnsAVMToThePool(t *testing.T) {
	t.Parallel()
	h := startQEMUPool(t, poolStateDir(t))
	ctx := context.Background()
	h.setPool(t, 1)
	first := h.waitReady(t, 1)[0]
	vm, err := h.client.CreateVM(ctx, "used", guest)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create used = %+v, %v", vm, err)
	}
	// Held open: its inode cannot be reused while the test runs.
	f, err := os.Open(filepath.Join(h.dir, "vms", "used", "disk.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	fi, _ := f.Stat()
	usedDisk := fi.Sys().(*syscall.Stat_t).Ino

	if err := h.client.DeleteVM(ctx, "used"); err != nil {
		t.Fatal(err)
	}
	if fi, _ := f.Stat(); fi.Sys().(*syscall.Stat_t).Nlink != 0 {
		t.Fatal("the deleted vm's disk is still linked somewhere")
	}
	if !exits(vm.PID) {
		t.Fatalf("qemu %d of the deleted vm still runs", vm.PID)
	}
	next := h.waitReady(t, 1)[0]
	if next == first {
		t.Fatalf("the pool offers %s again after its vm was deleted", first)
	}
	if got := inode(t, filepath.Join(h.warmDir(next), "disk.qcow2")); got == usedDisk {
		t.Fatal("the new warm vm's disk is the deleted vm's")
	}
	if pid := onePID(t, h.warmDir(next)); pid == vm.PID {
		t.Fatal("the new warm vm is the deleted vm's process")
	}
}

func TestRestartDestroysOrphansAndKeepsUserVMs(t *testing.T) {
	t.Parallel()
	dir := poolStateDir(t)
	h := startQEMUPool(t, dir)
	ctx := context.Background()
	h.setPool(t, 2)
	h.waitReady(t, 2)
	// The registry as it is now lists the warm VM u-warm gets: restored
	// below, it stands for a registry write that failed after the take.
	stale, err := os.ReadFile(filepath.Join(dir, "pool.json"))
	if err != nil {
		t.Fatal(err)
	}
	users := map[string]agentapi.VMSpec{"u-warm": guest, "u-cold": {Image: guest.Image, VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, NoWarm: true}}
	pids := map[string]int{}
	for _, id := range []string{"u-warm", "u-cold"} {
		vm, err := h.client.CreateVM(ctx, id, users[id])
		if err != nil {
			t.Fatal(err)
		}
		pids[id] = vm.PID
	}
	if vm, _ := h.client.GetVM(ctx, "u-warm"); vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("u-warm = %+v, want a warm start", vm)
	}
	var orphans []int
	for _, id := range h.waitReady(t, 2) {
		orphans = append(orphans, onePID(t, h.warmDir(id)))
	}
	h.waitTick(t, "u-warm", 1)

	h.stop()
	if err := os.WriteFile(filepath.Join(dir, "pool.json"), stale, 0o600); err != nil {
		t.Fatal(err)
	}
	h = startQEMUPool(t, dir)
	for _, pid := range orphans {
		if !exits(pid) {
			t.Errorf("orphan warm vm qemu %d survived the restart", pid)
		}
	}
	for id, pid := range pids {
		vm, err := h.client.GetVM(ctx, id)
		if err != nil || vm.State != agentapi.StateRunning || vm.PID != pid || !pidAlive(pid) {
			t.Fatalf("user vm %s after the restart = %+v, %v; want running with pid %d", id, vm, err, pid)
		}
	}
	con, _ := h.client.Console(ctx, "u-warm")
	h.waitTick(t, "u-warm", lastTick(con)+1)

	// Its metadata lost, a warm-started VM is still ended by its delete.
	h.stop()
	if err := os.WriteFile(filepath.Join(dir, "vms", "u-warm", "vm.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	h = startQEMUPool(t, dir)
	if err := h.client.DeleteVM(ctx, "u-warm"); err != nil {
		t.Fatal(err)
	}
	if !exits(pids["u-warm"]) {
		t.Fatalf("qemu %d of the deleted warm-started vm with corrupt metadata still runs", pids["u-warm"])
	}
	if vm, err := h.client.GetVM(ctx, "u-cold"); err != nil || vm.PID != pids["u-cold"] || vm.State != agentapi.StateRunning {
		t.Fatalf("u-cold = %+v, %v", vm, err)
	}
}

func TestFailedResumeFallsBackToAColdBoot(t *testing.T) {
	t.Parallel()
	h := startQEMUPool(t, poolStateDir(t))
	ctx := context.Background()
	h.setPool(t, 1)
	w := h.waitReady(t, 1)[0]
	pid := onePID(t, h.warmDir(w))
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); pidAlive(pid) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}

	vm, err := h.client.CreateVM(ctx, "fallback", guest)
	if err != nil || vm.StartedFrom != agentapi.StartedCold || vm.State != agentapi.StateRunning || vm.PID == pid {
		t.Fatalf("create fallback = %+v, %v; want a cold start in a new process", vm, err)
	}
	if st := qmpRunState(t, filepath.Join(h.dir, "vms", "fallback", "qmp.sock")); st != "running" {
		t.Fatalf("vm fallback reported running, qemu says %q", st)
	}
	if _, err := os.Lstat(h.warmDir(w)); err == nil {
		t.Fatalf("the dead warm vm %s was not destroyed", w)
	}
	h.waitTick(t, "fallback", 1)
	h.waitReady(t, 1)
}
