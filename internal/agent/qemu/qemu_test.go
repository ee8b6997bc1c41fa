package qemu_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Guests boot under TCG here; a boot takes seconds, so waits are generous.
// They bound the test, they do not measure it.
const bootWait = 3 * time.Minute

var guest = agentapi.VMSpec{Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}

func startQEMUAgent(t *testing.T) *testenv.Agent {
	t.Helper()
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	// Belt and braces: kill this test's guests by pid even if the agent's
	// own cleanup could not run.
	t.Cleanup(func() {
		dirs, _ := filepath.Glob(filepath.Join(a.StateDir, "vms", "*"))
		for _, dir := range dirs {
			for _, pid := range qemu.ProcessesOf(dir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	return a
}

// waitConsole waits until the console of vm shows pattern at least n times
// and returns the console.
func waitConsole(t *testing.T, a *testenv.Agent, id, pattern string, n int) string {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(bootWait)
	var con string
	for time.Now().Before(deadline) {
		var err error
		con, err = a.Client.Console(context.Background(), id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if len(re.FindAllString(con, -1)) >= n {
			return con
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("vm %s: %q did not appear %d times on the console within %s; console:\n%s", id, pattern, n, bootWait, con)
	return ""
}

func pidAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	state := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])[0]
	return state != "Z" && state != "X"
}

func processesOf(a *testenv.Agent, id string) []int {
	return qemu.ProcessesOf(filepath.Join(a.StateDir, "vms", id))
}

func TestGuestLifecycle(t *testing.T) {
	t.Parallel()
	a := startQEMUAgent(t)
	ctx := context.Background()

	// Three PUTs at once, then one more: one QEMU process.
	created := make(chan agentapi.VM, 3)
	for i := 0; i < 3; i++ {
		go func() {
			vm, err := a.Client.CreateVM(ctx, "life", guest)
			if err != nil {
				t.Errorf("concurrent create: %v", err)
			}
			created <- vm
		}()
	}
	vm := <-created
	for i := 1; i < 3; i++ {
		if other := <-created; other.PID != vm.PID {
			t.Fatalf("concurrent PUTs made two vms: pids %d and %d", vm.PID, other.PID)
		}
	}
	if vm.State != agentapi.StateRunning || vm.PID == 0 {
		t.Fatalf("created vm = %+v, want running with a pid", vm)
	}
	again, err := a.Client.CreateVM(ctx, "life", guest)
	if err != nil || again.PID != vm.PID {
		t.Fatalf("another PUT = %+v, %v; want the same vm (pid %d)", again, err, vm.PID)
	}
	if pids := processesOf(a, "life"); len(pids) != 1 || pids[0] != vm.PID {
		t.Fatalf("qemu processes of the vm after four PUTs: %v, want [%d]", pids, vm.PID)
	}
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", vm.PID))
	if !strings.Contains(string(cmdline), "guest=life") {
		t.Fatalf("qemu command line does not name the vm: %q", cmdline)
	}

	waitConsole(t, a, "life", `(?m)^kvm-guest-ready\r?$`, 1)
	// The disk line comes before the first tick.
	con := waitConsole(t, a, "life", `(?m)^tick 1\r?$`, 1)
	wantDisk := fmt.Sprintf("disk vda %d", guest.DiskMiB<<20)
	if !strings.Contains(con, wantDisk) {
		t.Fatalf("guest does not see a %d MiB disk (want %q); console:\n%s", guest.DiskMiB, wantDisk, con)
	}
	if !strings.Contains(con, "vmgenid present") {
		t.Fatalf("guest does not see the vmgenid device; console:\n%s", con)
	}

	if vm, err = a.Client.Action(ctx, "life", agentapi.ActionPause); err != nil || vm.State != agentapi.StatePaused {
		t.Fatalf("pause: %+v, %v", vm, err)
	}
	if got, err := a.Client.GetVM(ctx, "life"); err != nil || got.State != agentapi.StatePaused {
		t.Fatalf("GET after pause: %+v, %v", got, err)
	}
	if vm, err = a.Client.Action(ctx, "life", agentapi.ActionResume); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("resume: %+v, %v", vm, err)
	}

	pid := vm.PID
	if vm, err = a.Client.Action(ctx, "life", agentapi.ActionStop); err != nil || vm.State != agentapi.StateStopped {
		t.Fatalf("stop: %+v, %v", vm, err)
	}
	if pidAlive(pid) || len(processesOf(a, "life")) != 0 {
		t.Fatalf("qemu %d still runs after stop", pid)
	}
	if con, _ := a.Client.Console(ctx, "life"); !strings.Contains(con, "kvm-guest-powerdown") {
		t.Fatalf("the guest did not see the ACPI power-down; console:\n%s", con)
	}
	if vm, err = a.Client.Action(ctx, "life", agentapi.ActionStart); err != nil || vm.State != agentapi.StateRunning || vm.PID == pid {
		t.Fatalf("start: %+v, %v; want running with a new process", vm, err)
	}
	// The console log is appended across boots: a second ready line, and
	// the same disk again.
	waitConsole(t, a, "life", `(?m)^kvm-guest-ready\r?$`, 2)
	waitConsole(t, a, "life", "(?m)^"+wantDisk+"\r?$", 2)

	pid = vm.PID
	if err := a.Client.DeleteVM(ctx, "life"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if pidAlive(pid) {
		t.Fatalf("qemu %d still runs after delete", pid)
	}
	if _, err := os.Stat(filepath.Join(a.StateDir, "vms", "life")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("vm files still there after delete: %v", err)
	}
	if err := a.Client.DeleteVM(ctx, "life"); err != nil {
		t.Fatalf("second delete: %v, want 204", err)
	}
	if _, err := a.Client.GetVM(ctx, "life"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Fatalf("GET after delete: %v, want not found", err)
	}
}

func TestRestartReadoptsGuestsAndSeesKilledOnes(t *testing.T) {
	t.Parallel()
	a := startQEMUAgent(t)
	ctx := context.Background()
	pids := map[string]int{}
	for _, id := range []string{"keep", "kill"} {
		vm, err := a.Client.CreateVM(ctx, id, guest)
		if err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		pids[id] = vm.PID
	}

	a.Restart(t)
	vms, err := a.Client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 2 {
		t.Fatalf("after restart: %+v, want 2 vms", vms)
	}
	for _, vm := range vms {
		if vm.State != agentapi.StateRunning || vm.PID != pids[vm.ID] || !pidAlive(vm.PID) {
			t.Fatalf("after restart vm %s = %+v, want running with pid %d", vm.ID, vm, pids[vm.ID])
		}
	}
	// The guests kept running through the restart.
	waitConsole(t, a, "keep", `(?m)^tick 1\r?$`, 1)

	if err := syscall.Kill(pids["kill"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); pidAlive(pids["kill"]) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	killed, err := a.Client.GetVM(ctx, "kill")
	if err != nil || killed.State != agentapi.StateStopped || killed.Reason == "" {
		t.Fatalf("killed vm = %+v, %v; want stopped with a reason", killed, err)
	}
	kept, err := a.Client.GetVM(ctx, "keep")
	if err != nil || kept.State != agentapi.StateRunning || kept.PID != pids["keep"] {
		t.Fatalf("other vm = %+v, %v; want running with pid %d", kept, err, pids["keep"])
	}

	// An agent that died between starting QEMU and recording its pid left
	// metadata saying "creating" without a process: the next agent finds
	// the QEMU by its command line and adopts it.
	meta := filepath.Join(a.StateDir, "vms", "keep", "vm.json")
	a.Stop()
	var rec map[string]any
	b, err := os.ReadFile(meta)
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err != nil {
		t.Fatal(err)
	}
	rec["state"], rec["process"] = agentapi.StateCreating, map[string]any{}
	if b, err = json.Marshal(rec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(meta, b, 0o600); err != nil {
		t.Fatal(err)
	}
	a.Restart(t)
	if vm, err := a.Client.GetVM(ctx, "keep"); err != nil || vm.State != agentapi.StateRunning || vm.PID != pids["keep"] {
		t.Fatalf("vm whose pid was not recorded = %+v, %v; want running with pid %d", vm, err, pids["keep"])
	}

	// A corrupt metadata file: moved aside, only that VM in error, the
	// others served; deleting it still ends its QEMU.
	a.Stop()
	if err := os.WriteFile(meta, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	a.Restart(t)
	bad, err := a.Client.GetVM(ctx, "keep")
	if err != nil || bad.State != agentapi.StateError || !strings.Contains(bad.Reason, "corrupt") {
		t.Fatalf("vm with corrupt metadata = %+v, %v; want error with the reason", bad, err)
	}
	if _, err := os.Stat(meta + ".corrupt"); err != nil {
		t.Fatalf("corrupt metadata not moved aside: %v", err)
	}
	if other, err := a.Client.GetVM(ctx, "kill"); err != nil || other.State != agentapi.StateStopped {
		t.Fatalf("other vm = %+v, %v; want it served, stopped", other, err)
	}
	if err := a.Client.DeleteVM(ctx, "keep"); err != nil {
		t.Fatalf("delete corrupt vm: %v", err)
	}
	if pidAlive(pids["keep"]) {
		t.Fatalf("qemu %d of the corrupt vm still runs after delete", pids["keep"])
	}
}

func TestBadInputStartsNothing(t *testing.T) {
	t.Parallel()
	a := startQEMUAgent(t)
	put := func(id, body, token string) (int, string) {
		req, _ := http.NewRequest(http.MethodPut, a.URL+"/v1/vms/"+id, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	cases := []struct{ name, body, token string }{
		{"unknown image", `{"image":"nope","vcpus":1,"memory_mib":128,"disk_mib":8}`, a.Token},
		{"zero memory", `{"image":"busybox","vcpus":1,"memory_mib":0,"disk_mib":8}`, a.Token},
		{"too little memory", `{"image":"busybox","vcpus":1,"memory_mib":16,"disk_mib":8}`, a.Token},
		{"malformed json", `{"image":"busybox"`, a.Token},
		{"wrong token", `{"image":"busybox","vcpus":1,"memory_mib":128,"disk_mib":8}`, "nope"},
	}
	for _, tc := range cases {
		status, body := put("bad", tc.body, tc.token)
		if status < 400 || status >= 500 {
			t.Errorf("%s: status %d, want 4xx: %s", tc.name, status, body)
		}
	}
	if pids := processesOf(a, "bad"); len(pids) != 0 {
		t.Fatalf("bad input started qemu %v", pids)
	}
	if entries, _ := os.ReadDir(filepath.Join(a.StateDir, "vms")); len(entries) != 0 {
		t.Fatalf("bad input left %d vm directories", len(entries))
	}
}

func TestInfoReportsHostAndAccel(t *testing.T) {
	t.Parallel()
	a := startQEMUAgent(t)
	info, err := a.Client.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Driver != "qemu" || (info.Accel != "tcg" && info.Accel != "kvm") || info.AccelNote == "" ||
		info.Capacity.VCPUs < 1 || info.Capacity.MemoryMiB < 1 || info.Capacity.DiskMiB < 1 {
		t.Fatalf("info = %+v", info)
	}
	found := false
	for _, img := range info.Images {
		found = found || img == "busybox"
	}
	if !found {
		t.Fatalf("images %v do not list busybox", info.Images)
	}
}

// A guest that ignores the ACPI power button still stops: after the grace
// period the agent quits QEMU.
func TestStopEndsGuestThatIgnoresACPI(t *testing.T) {
	t.Parallel()
	src := filepath.Join(testenv.GuestImageDir(t), "busybox")
	images := t.TempDir()
	dir := filepath.Join(images, "deaf")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if err := os.Symlink(filepath.Join(src, f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	manifest := `{"kind":"kernel","kernel":"vmlinux","initrd":"initrd.img","machine":"q35",` +
		`"cmdline":"console=ttyS0 panic=-1 loglevel=4 kvm_guest_ignore_acpi"}`
	if err := os.WriteFile(filepath.Join(dir, "image.json"), []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: images})
	ctx := context.Background()
	spec := guest
	spec.Image, spec.DiskMiB = "deaf", 0
	vm, err := a.Client.CreateVM(ctx, "deaf", spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	con := waitConsole(t, a, "deaf", `(?m)^tick 1\r?$`, 1)
	if !strings.Contains(con, "disk none") {
		t.Fatalf("a vm with disk_mib 0 has a disk; console:\n%s", con)
	}
	stopped, err := a.Client.Action(ctx, "deaf", agentapi.ActionStop)
	if err != nil || stopped.State != agentapi.StateStopped {
		t.Fatalf("stop: %+v, %v", stopped, err)
	}
	if pidAlive(vm.PID) {
		t.Fatalf("qemu %d still runs after stop", vm.PID)
	}
	if con, _ := a.Client.Console(ctx, "deaf"); strings.Contains(con, "kvm-guest-powerdown") {
		t.Fatalf("the guest powered itself off: this test no longer covers the timeout path; console:\n%s", con)
	}
}

// A unix socket path holds at most 108 bytes; state directories can be
// longer. QMP must still work (QEMU binds relative to the VM directory, the
// agent connects through /proc/self/fd).
func TestLongStateDirectory(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 120))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", StateDir: dir})
	ctx := context.Background()
	spec := guest
	spec.DiskMiB = 0
	vm, err := a.Client.CreateVM(ctx, "long", spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if vm, err = a.Client.Action(ctx, "long", agentapi.ActionPause); err != nil || vm.State != agentapi.StatePaused {
		t.Fatalf("pause over qmp: %+v, %v", vm, err)
	}
	if got, err := a.Client.GetVM(ctx, "long"); err != nil || got.State != agentapi.StatePaused {
		t.Fatalf("query-status over qmp: %+v, %v", got, err)
	}
	if err := a.Client.DeleteVM(ctx, "long"); err != nil {
		t.Fatalf("delete: %v", err)
	}
}

// Every QEMU option value built from a path is comma-escaped: a state
// directory with a comma in its name boots a guest with its disk, console
// and QMP socket there (unescaped, QEMU reads the rest of the path as
// another option and refuses to start).
func TestCommaInStateDirectory(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "state,file=x,readonly=on")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", StateDir: dir})
	ctx := context.Background()
	_, err := a.Client.CreateVM(ctx, "comma", guest)
	if err != nil {
		t.Fatalf("create in a state directory with commas: %v", err)
	}
	waitConsole(t, a, "comma", "kvm-guest-ready", 1)
	if got, err := a.Client.Action(ctx, "comma", agentapi.ActionPause); err != nil || got.State != agentapi.StatePaused {
		t.Fatalf("pause over qmp: %+v, %v", got, err)
	}
	if err := a.Client.DeleteVM(ctx, "comma"); err != nil {
		t.Fatalf("delete: %v", err)
	}
}
