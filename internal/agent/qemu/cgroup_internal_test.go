package qemu

import (
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// fakeCgroupRoot is a directory laid out like a cgroup2 root with the given
// controllers, and a mount table that names it.
func fakeCgroupRoot(t *testing.T, controllers string) (root, mounts string) {
	t.Helper()
	root = t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte(controllers+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	mounts = filepath.Join(t.TempDir(), "mounts")
	table := "proc /proc proc rw 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\ncgroup2 " + root + " cgroup2 rw 0 0\n"
	if err := os.WriteFile(mounts, []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	return root, mounts
}

func readTrim(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// TestCgroupPerVMLimits: on a cgroup2 root with memory and cpu, as root, the
// parent cgroup enables both for its children and each VM's cgroup gets
// memory.max (its memory + overhead, more under TCG) and cpu.max (its
// vcpus) and cpu.weight.nice (its QEMU's nice value: below the agent,
// lower still for a warm boot, and settable at handover); the parent
// weighs like a task at the VMs' nice value; the start gets a descriptor.
func TestCgroupPerVMLimits(t *testing.T) {
	root, mounts := fakeCgroupRoot(t, "cpuset cpu io memory pids")
	cg := detectCgroups(mounts, 0, 5, slog.New(slog.DiscardHandler))
	if cg.dir != filepath.Join(root, cgroupParentName) {
		t.Fatalf("parent cgroup = %q (%s), want %s", cg.dir, cg.note, filepath.Join(root, cgroupParentName))
	}
	if !strings.HasPrefix(cg.note, "cgroup v2") {
		t.Errorf("isolation note = %q", cg.note)
	}
	for _, dir := range []string{root, cg.dir} {
		if got := readTrim(t, filepath.Join(dir, "cgroup.subtree_control")); got != "+memory +cpu" {
			t.Errorf("%s/cgroup.subtree_control = %q", dir, got)
		}
	}
	if got := readTrim(t, filepath.Join(cg.dir, "cpu.weight.nice")); got != "5" {
		t.Errorf("%s/cpu.weight.nice = %q, want 5 (the VMs' nice value, below the agent)", cg.dir, got)
	}
	for _, tc := range []struct {
		tcg     bool
		wantMiB int64
	}{{false, 1024 + 256 + 128}, {true, 1024 + 256 + 128 + 1024}} {
		fd := cg.prepare("/var/lib/kvmd/vms/vm-1", vmShape{id: "vm-1", vcpus: 3, memoryMiB: 1024, nice: 5}, tc.tcg)
		if fd < 0 {
			t.Fatal("no cgroup descriptor")
		}
		_ = syscall.Close(fd)
		vmDir := filepath.Join(cg.dir, "vm-1")
		if got, want := readTrim(t, filepath.Join(vmDir, "memory.max")), tc.wantMiB<<20; got != strconv.FormatInt(want, 10) {
			t.Errorf("tcg=%v: memory.max = %s, want %d", tc.tcg, got, want)
		}
		if got := readTrim(t, filepath.Join(vmDir, "cpu.max")); got != "300000 100000" {
			t.Errorf("cpu.max = %q, want 3 vcpus' worth", got)
		}
		if got := readTrim(t, filepath.Join(vmDir, "cpu.weight.nice")); got != "5" {
			t.Errorf("cpu.weight.nice = %q, want its qemu's nice value 5", got)
		}
	}
	// A warm boot: below the user VMs until its handover.
	fd := cg.prepare("/var/lib/kvmd/pool/warm-1", vmShape{id: "warm-1", vcpus: 1, memoryMiB: 128, nice: 10}, true)
	if fd < 0 {
		t.Fatal("no cgroup descriptor")
	}
	_ = syscall.Close(fd)
	warmDir := filepath.Join(cg.dir, "warm-1")
	if got := readTrim(t, filepath.Join(warmDir, "cpu.weight.nice")); got != "10" {
		t.Errorf("warm boot: cpu.weight.nice = %q, want 10", got)
	}
	if err := cg.setNice("/var/lib/kvmd/pool/warm-1", 5); err != nil {
		t.Fatal(err)
	}
	if got := readTrim(t, filepath.Join(warmDir, "cpu.weight.nice")); got != "5" {
		t.Errorf("after the handover: cpu.weight.nice = %q, want 5", got)
	}
}

// TestCgroupsDegradeWithAReason: without root, without cgroup2, or without
// the controllers, VMs run without a cgroup and the note says why.
func TestCgroupsDegradeWithAReason(t *testing.T) {
	_, mounts := fakeCgroupRoot(t, "cpu memory")
	_, v1only := fakeCgroupRoot(t, "hugetlb")
	noV2 := filepath.Join(t.TempDir(), "mounts")
	if err := os.WriteFile(noV2, []byte("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		mounts string
		euid   int
		want   string
	}{
		"not root":       {mounts, 1000, "does not run as root"},
		"no cgroup2":     {noV2, 0, "no cgroup v2 filesystem"},
		"no controllers": {v1only, 0, "no memory controller"},
	} {
		cg := detectCgroups(tc.mounts, tc.euid, 5, slog.New(slog.DiscardHandler))
		if cg.dir != "" || !strings.HasPrefix(cg.note, "none: ") || !strings.Contains(cg.note, tc.want) {
			t.Errorf("%s: dir %q note %q; want no cgroups and a note with %q", name, cg.dir, cg.note, tc.want)
		}
		if fd := cg.prepare("/x/vm-1", vmShape{id: "vm-1", vcpus: 1, memoryMiB: 128}, false); fd != -1 {
			t.Errorf("%s: prepare gave a descriptor without cgroups", name)
		}
		if err := cg.setNice("/x/vm-1", 5); err != nil {
			t.Errorf("%s: setNice without cgroups: %v", name, err)
		}
	}
}
