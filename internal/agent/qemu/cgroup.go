package qemu

// Each QEMU runs in a cgroup (v2) of its own, so that one guest cannot
// starve the host, the agent or the control plane: memory.max is the VM's
// memory plus QEMU's own overhead, cpu.max its vCPUs' worth of CPU time,
// cpu.weight.nice the nice value its QEMU runs at (priority.go).
// That needs root and a cgroup2 hierarchy with the memory and cpu
// controllers (a unified host; on a hybrid host they belong to cgroup v1);
// without them VMs run unlimited, the agent logs why once and reports it in
// /v1/info (isolation). Hand-written: a few files under /sys/fs/cgroup are
// all it takes, no library needed.

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	// cgroupParentName is the cgroup under the cgroup2 root that holds one
	// cgroup per VM.
	cgroupParentName = "kvmd-vms"
	// qemuOverheadMiB is QEMU's own memory beside the guest's: its code,
	// device emulation, I/O buffers, plus guestMemory/8 (page tables and
	// the like, see memoryMaxMiB).
	qemuOverheadMiB = 256
	// tcgOverheadMiB is the translation cache a TCG guest may fill (QEMU's
	// default tb-size is up to 1 GiB).
	tcgOverheadMiB = 1024
	// cpuPeriod is the cpu.max period in microseconds.
	cpuPeriod = 100000
)

// cgroups places VMs in their own cgroups under dir; dir is "" when that is
// not possible, and note says why (or how VMs are held, when it is).
type cgroups struct {
	dir  string
	note string
	log  *slog.Logger
}

// detectCgroups finds the cgroup2 hierarchy in the mount table at mounts
// (/proc/self/mounts), checks that it can limit memory and CPU, and makes
// the parent cgroup with both controllers enabled for its children, which
// weighs like one task at nice against its siblings (the agent's cgroup).
func detectCgroups(mounts string, euid, nice int, log *slog.Logger) *cgroups {
	cg := &cgroups{log: log}
	none := func(format string, args ...any) *cgroups {
		cg.note = "none: " + fmt.Sprintf(format, args...) + "; vms run without memory and cpu limits"
		log.Warn("vms are not isolated in cgroups", "why", cg.note)
		return cg
	}
	if euid != 0 {
		return none("the agent does not run as root (a cgroup per vm needs root)")
	}
	root, err := cgroup2Mount(mounts)
	if err != nil {
		return none("%v", err)
	}
	b, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return none("read the cgroup v2 controllers: %v", err)
	}
	have := strings.Fields(string(b))
	for _, c := range []string{"memory", "cpu"} {
		if !slices.Contains(have, c) {
			return none("the cgroup v2 hierarchy at %s has no %s controller (it has %q; on a hybrid host it belongs to cgroup v1)", root, c, have)
		}
	}
	if err := writeCgroupFile(root, "cgroup.subtree_control", "+memory +cpu"); err != nil {
		return none("enable the memory and cpu controllers at %s: %v", root, err)
	}
	dir := filepath.Join(root, cgroupParentName)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return none("create cgroup %s: %v", dir, err)
	}
	if err := writeCgroupFile(dir, "cgroup.subtree_control", "+memory +cpu"); err != nil {
		return none("enable the memory and cpu controllers in %s: %v", dir, err)
	}
	if err := writeCgroupFile(dir, "cpu.weight.nice", strconv.Itoa(nice)); err != nil {
		return none("set the cpu weight of %s: %v", dir, err)
	}
	cg.dir = dir
	cg.note = fmt.Sprintf("cgroup v2: each vm in %s/<vm> with memory.max (its memory + %d MiB + 1/8, + %d MiB under tcg), cpu.max (its vcpus) "+
		"and cpu.weight.nice (its qemu's nice value; %s itself at nice %d)",
		dir, qemuOverheadMiB, tcgOverheadMiB, cgroupParentName, nice)
	log.Info("vms are isolated in cgroups", "parent", dir)
	return cg
}

// cgroup2Mount is the mount point of the cgroup2 filesystem in a mount table.
func cgroup2Mount(mounts string) (string, error) {
	f, err := os.Open(mounts)
	if err != nil {
		return "", fmt.Errorf("read the mount table: %w", err)
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 3 && fields[2] == "cgroup2" {
			return fields[1], nil
		}
	}
	return "", errors.New("no cgroup v2 filesystem is mounted")
}

func writeCgroupFile(dir, name, value string) error {
	return os.WriteFile(filepath.Join(dir, name), []byte(value), 0o644)
}

// memoryMaxMiB is memory.max of a VM with memoryMiB of guest memory.
func memoryMaxMiB(memoryMiB int64, tcg bool) int64 {
	limit := memoryMiB + qemuOverheadMiB + memoryMiB/8
	if tcg {
		limit += tcgOverheadMiB
	}
	return limit
}

// prepare makes (or updates) the cgroup of the VM whose QEMU starts in
// launchDir and returns an open descriptor of it for the start (clone into
// it: the process never runs outside), to close after the start; -1 when
// VMs are not isolated or the cgroup could not be made (logged).
func (cg *cgroups) prepare(launchDir string, m vmShape, tcg bool) int {
	if cg == nil || cg.dir == "" {
		return -1
	}
	dir := filepath.Join(cg.dir, filepath.Base(launchDir))
	fail := func(err error) int {
		cg.log.Error("vm runs without cgroup limits", "vm", m.id, "cgroup", dir, "err", err)
		return -1
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fail(err)
	}
	if err := writeCgroupFile(dir, "memory.max", strconv.FormatInt(memoryMaxMiB(m.memoryMiB, tcg)<<20, 10)); err != nil {
		return fail(err)
	}
	if err := writeCgroupFile(dir, "cpu.max", fmt.Sprintf("%d %d", m.vcpus*cpuPeriod, cpuPeriod)); err != nil {
		return fail(err)
	}
	if err := writeCgroupFile(dir, "cpu.weight.nice", strconv.Itoa(max(m.nice, 0))); err != nil {
		return fail(err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	return fd
}

// setNice sets the cpu.weight.nice of the cgroup of the VM whose QEMU
// started in launchDir (a warm VM handed over gets the user VMs' weight).
func (cg *cgroups) setNice(launchDir string, nice int) error {
	if cg == nil || cg.dir == "" {
		return nil
	}
	dir := filepath.Join(cg.dir, filepath.Base(launchDir))
	if err := writeCgroupFile(dir, "cpu.weight.nice", strconv.Itoa(nice)); err != nil {
		return fmt.Errorf("set the cpu weight of cgroup %s: %w", dir, err)
	}
	return nil
}

// remove removes the cgroups of a VM whose processes ended (one per
// directory its QEMUs started in), whether they were killed or quit. A
// cgroup that still holds a process stays (rmdir refuses for a second);
// the next kill tries again.
func (cg *cgroups) remove(launchDirs ...string) {
	if cg == nil || cg.dir == "" {
		return
	}
	for _, d := range launchDirs {
		if d == "" {
			continue
		}
		dir := filepath.Join(cg.dir, filepath.Base(d))
		// A process that has just ended may still be leaving its cgroup
		// (EBUSY for a moment): a few bounded retries.
		err := syscall.Rmdir(dir)
		for i := 0; errors.Is(err, syscall.EBUSY) && i < 50; i++ {
			time.Sleep(20 * time.Millisecond)
			err = syscall.Rmdir(dir)
		}
		if err != nil && !errors.Is(err, syscall.ENOENT) {
			cg.log.Warn("remove the cgroup of an ended vm", "cgroup", dir, "err", err)
		}
	}
}

// vmShape is what a VM's cgroup limits derive from.
type vmShape struct {
	id        string
	vcpus     int64
	memoryMiB int64
	nice      int // its QEMU's nice value (-1: the agent's, weighed as 0)
}
