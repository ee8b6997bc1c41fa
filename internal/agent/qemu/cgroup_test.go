package qemu_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestGuestRunsInItsOwnCgroup: a real QEMU guest's process is in a cgroup of
// its own whose memory.max is the guest's memory plus QEMU's overhead and
// whose cpu.max is its vCPUs. Where the agent cannot use cgroups (not root,
// no cgroup2 memory and cpu controllers, as on a hybrid cgroup v1 host) its
// info must say why, and the test skips with that reason unless
// KVM_REQUIRE_CGROUPS=1.
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
		t.Skipf("the agent reports no cgroups here: %s", info.Isolation)
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
	if err := a.Client.DeleteVM(ctx, "cg"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("cgroup %s is left after the delete: %v", dir, err)
	}
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
