package qemu_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
)

// TestGuestRunsInItsOwnCgroup: a real QEMU guest's process is in a cgroup of
// its own whose memory.max is the guest's memory plus QEMU's overhead and
// whose cpu.max is its vCPUs. Where the agent cannot use cgroups (not root,
// no cgroup2 memory and cpu controllers, as on a hybrid cgroup v1 host) its
// info must say why, and the test skips with that reason unless
// KVM_REQUIRE_CGROUPS=1 (.ci/run sets it wherever /proc/cgroups shows
// both controllers free of cgroup v1), with what it measured: which v1
// hierarchy holds each controller, and what a cgroup2 mounted afresh in a
// mount namespace of its own offers. On such a host, package cgrouptest
// runs this test inside a Debian guest, whose kernel has cgroup v2 with
// both controllers.
func TestGuestRunsInItsOwnCgroup(t *testing.T) {
	a := startQEMUAgent(t)
	ctx := context.Background()
	info, err := a.Client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(info.Isolation, "none: ") {
		if os.Getenv("KVM_REQUIRE_CGROUPS") == "1" {
			t.Fatalf("KVM_REQUIRE_CGROUPS=1 but the agent cannot use cgroups: %s", info.Isolation)
		}
		t.Skipf("the agent reports no cgroups here: %s. Measured: %s", info.Isolation, cgroupV2Unavailable(t))
	}
	if !strings.HasPrefix(info.Isolation, "cgroup v2") {
		t.Fatalf("isolation = %q, want cgroup v2 or none: <why>", info.Isolation)
	}
	vm, err := a.Client.CreateVM(ctx, "cg", guest)
	if err != nil {
		t.Fatal(err)
	}
	rel := cgroupOf(t, vm.PID)
	if filepath.Base(rel) != "cg" || filepath.Base(filepath.Dir(rel)) != "kvmd-vms" {
		t.Fatalf("qemu %d is in cgroup %q, want .../kvmd-vms/cg", vm.PID, rel)
	}
	dir := filepath.Join(cgroup2Root(t), rel)
	mem := readFile(t, filepath.Join(dir, "memory.max"))
	limit, err := strconv.ParseInt(mem, 10, 64)
	if err != nil {
		t.Fatalf("memory.max = %q: %v", mem, err)
	}
	if min := guest.MemoryMiB << 20; limit <= min || limit > min+(2<<30) {
		t.Errorf("memory.max = %d bytes for a %d MiB guest; want the guest's memory plus an overhead", limit, guest.MemoryMiB)
	}
	if got, want := readFile(t, filepath.Join(dir, "cpu.max")), fmt.Sprintf("%d 100000", guest.VCPUs*100000); got != want {
		t.Errorf("cpu.max = %q, want %q", got, want)
	}
	// The controllers account the guest's QEMU in that cgroup: its memory
	// is charged there and its CPU time counted.
	if cur, err := strconv.ParseInt(readFile(t, filepath.Join(dir, "memory.current")), 10, 64); err != nil || cur <= 0 {
		t.Errorf("memory.current of %s = %d (%v); want the running QEMU's memory charged to its cgroup", dir, cur, err)
	}
	var usage int64
	for _, l := range strings.Split(readFile(t, filepath.Join(dir, "cpu.stat")), "\n") {
		if v, ok := strings.CutPrefix(l, "usage_usec "); ok {
			usage, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	if usage <= 0 {
		t.Errorf("cpu.stat of %s counts usage_usec %d; want the running QEMU's CPU time counted in its cgroup", dir, usage)
	}
	t.Logf("vm cg in %s: memory.max %d, cpu.max %q, memory.current %s, cpu usage %d µs", rel, limit,
		readFile(t, filepath.Join(dir, "cpu.max")), readFile(t, filepath.Join(dir, "memory.current")), usage)
	// Below the agent: the VM's cgroup and kvmd-vms, their parent, weigh
	// like tasks at the VMs' nice value.
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if got, want := readFile(t, filepath.Join(d, "cpu.weight.nice")), strconv.Itoa(qemu.DefaultNice); got != want {
			t.Errorf("%s/cpu.weight.nice = %q, want %q", d, got, want)
		}
	}
	if err := a.Client.DeleteVM(ctx, "cg"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("cgroup %s is left after the delete: %v", dir, err)
	}
}

// cgroupV2Unavailable says, measured, why no cgroup2 mount here can have
// the memory and cpu controllers: /proc/cgroups names the cgroup v1
// hierarchy each is bound to (0: none, free for cgroup v2) and how many
// cgroups it holds, and a cgroup2 mounted afresh in a private mount
// namespace (unshare -m, as root) lists the controllers it offers. A
// controller bound to a v1 hierarchy joins cgroup v2 only once that
// hierarchy is unmounted in every mount namespace and holds no cgroup but
// its root: a mount namespace or a cgroup namespace of the test's own does
// not release it, and the test does not take it from its host.
func cgroupV2Unavailable(t *testing.T) string {
	t.Helper()
	var facts []string
	for _, l := range strings.Split(readFile(t, "/proc/cgroups"), "\n") {
		f := strings.Fields(l)
		if len(f) == 4 && (f[0] == "memory" || f[0] == "cpu") {
			facts = append(facts, fmt.Sprintf("/proc/cgroups binds %s to cgroup v1 hierarchy %s (%s cgroups, enabled %s)", f[0], f[1], f[2], f[3]))
		}
	}
	if os.Geteuid() == 0 {
		dir := t.TempDir()
		out, err := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
			`mount -t cgroup2 none "$1" && cat "$1/cgroup.controllers"`, "sh", dir).CombinedOutput()
		if err != nil {
			facts = append(facts, fmt.Sprintf("a cgroup2 mount in a private mount namespace failed: %v: %s", err, strings.TrimSpace(string(out))))
		} else {
			facts = append(facts, fmt.Sprintf("a cgroup2 mounted afresh in a private mount namespace (unshare -m) offers %q", strings.Fields(string(out))))
		}
	}
	return strings.Join(facts, "; ") + ": a controller bound to a v1 hierarchy joins cgroup v2 only once that hierarchy is unmounted in every mount namespace " +
		"and holds no child cgroups, which a test cannot do to its host (KVM_REQUIRE_CGROUPS=1 on a host with cgroup v2 memory and cpu runs it)"
}

// TestGuestRunsBelowTheAgent: every thread of a started QEMU runs at the
// VMs' nice value (qemu.DefaultNice), below the agent's own, from its
// start: the threads QEMU made before any setpriority could reach them
// (its vCPU, RCU and I/O threads) included; where VMs have cgroups, its
// cgroup weighs the same (cgroupWeightNice).
func TestGuestRunsBelowTheAgent(t *testing.T) {
	a := startQEMUAgent(t)
	ctx := context.Background()
	vm, err := a.Client.CreateVM(ctx, "low", guest)
	if err != nil {
		t.Fatal(err)
	}
	waitConsole(t, a, "low", `(?m)^kvm-guest-ready\r?$`, 1)
	// The agent's nice value, on this goroutine's thread (not a thread
	// that starts a QEMU of a parallel test); the kernel answers 20 - nice.
	prio, err := unix.Getpriority(unix.PRIO_PROCESS, unix.Gettid())
	if err != nil {
		t.Fatal(err)
	}
	self := 20 - prio
	if n := niceOf(t, vm.PID); n != qemu.DefaultNice || n <= self {
		t.Fatalf("qemu %d runs at nice %d, want %d, below the agent's %d", vm.PID, n, qemu.DefaultNice, self)
	}
	if cg := cgroupWeightNice(t, vm.PID); cg != "" && cg != strconv.Itoa(qemu.DefaultNice) {
		t.Fatalf("qemu %d: its cgroup's cpu.weight.nice = %s, want %d", vm.PID, cg, qemu.DefaultNice)
	}
	// Where the kernel groups tasks by session (autogroup), QEMU is in the
	// agent's group: in one of its own, its nice value would not count
	// against the agent. A task that autogroup does not place (in the
	// root group, or in a cpu cgroup of its own, which then weighs it)
	// shows an empty /proc/<pid>/autogroup.
	if on, err := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled"); err == nil && strings.TrimSpace(string(on)) == "1" {
		mine := strings.Fields(readFile(t, "/proc/self/autogroup"))
		theirs := strings.Fields(readFile(t, fmt.Sprintf("/proc/%d/autogroup", vm.PID)))
		if len(mine) > 0 && len(theirs) > 0 && theirs[0] != mine[0] {
			t.Fatalf("qemu %d is in autogroup %s, the agent in %s: its nice value does not count against the agent", vm.PID, theirs[0], mine[0])
		}
	}
}

// cgroupWeightNice is cpu.weight.nice of process pid's cgroup when it is a
// VM's cgroup (under kvmd-vms), "" when VMs run without cgroups here.
func cgroupWeightNice(t *testing.T, pid int) string {
	t.Helper()
	rel := cgroupOf(t, pid)
	if filepath.Base(filepath.Dir(rel)) != "kvmd-vms" {
		return ""
	}
	return readFile(t, filepath.Join(cgroup2Root(t), rel, "cpu.weight.nice"))
}

// cgroupOf is the cgroup v2 path of a process ("0::<path>" in /proc/<pid>/cgroup).
func cgroupOf(t *testing.T, pid int) string {
	t.Helper()
	for _, l := range strings.Split(readFile(t, fmt.Sprintf("/proc/%d/cgroup", pid)), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return p
		}
	}
	t.Fatalf("process %d has no cgroup v2 path", pid)
	return ""
}

func cgroup2Root(t *testing.T) string {
	t.Helper()
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if fields := strings.Fields(s.Text()); len(fields) >= 3 && fields[2] == "cgroup2" {
			return fields[1]
		}
	}
	t.Fatal("no cgroup2 mount")
	return ""
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}
