package qemu_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// procIdentity is what /proc/<pid>/status says of a process's identity and
// its seccomp filter.
type procIdentity struct {
	uids, gids     []uint32 // real, effective, saved, filesystem
	groups         []uint32
	seccomp        int // 0 none, 1 strict, 2 filter
	seccompFilters int
}

func readProcIdentity(t *testing.T, pid int) procIdentity {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("status of qemu %d: %v", pid, err)
	}
	ids := func(s string) []uint32 {
		var out []uint32
		for _, f := range strings.Fields(s) {
			n, err := strconv.ParseUint(f, 10, 32)
			if err != nil {
				t.Fatalf("qemu %d status: %q: %v", pid, s, err)
			}
			out = append(out, uint32(n))
		}
		return out
	}
	var id procIdentity
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "Uid":
			id.uids = ids(v)
		case "Gid":
			id.gids = ids(v)
		case "Groups":
			id.groups = ids(v)
		case "Seccomp":
			id.seccomp, _ = strconv.Atoi(strings.TrimSpace(v))
		case "Seccomp_filters":
			id.seccompFilters, _ = strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return id
}

// canAs says whether a process with id's uid, gid and groups passes test(1)'s
// check op (-r, -w) on path: the kernel's own answer, as QEMU would get it.
func canAs(t *testing.T, id procIdentity, op, path string) bool {
	t.Helper()
	cmd := exec.Command("test", op, path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: id.uids[0], Gid: id.gids[0], Groups: id.groups}}
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("test %s %s as uid %d: %v", op, path, id.uids[0], err)
	}
	return err == nil
}

// Each VM's QEMU runs under a seccomp filter and as a uid of its own, not
// root, that owns only that VM's disk: a QEMU that a guest took over can
// neither write nor read another VM's disk, its own metadata, nor the
// agent's key.
func TestQEMUIsSandboxedAndOwnsOnlyItsFiles(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the agent drops QEMU's privileges only when it runs as root")
	}
	a := startQEMUAgent(t)
	ctx := context.Background()
	pids := map[string]int{}
	for _, id := range []string{"sand-a", "sand-b"} {
		vm, err := a.Client.CreateVM(ctx, id, guest)
		if err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		pids[id] = vm.PID
	}
	ids := map[string]procIdentity{}
	for vm, pid := range pids {
		id := readProcIdentity(t, pid)
		if id.seccomp != 2 || id.seccompFilters < 1 {
			t.Errorf("qemu %d of vm %s: Seccomp %d, Seccomp_filters %d; want a filter (2, >= 1)", pid, vm, id.seccomp, id.seccompFilters)
		}
		for i, u := range id.uids {
			if u == 0 || u != id.uids[0] {
				t.Errorf("qemu %d of vm %s: uids %v (real, effective, saved, fs); want one non-root uid", pid, vm, id.uids)
				break
			}
			if id.gids[i] == 0 {
				t.Errorf("qemu %d of vm %s: gids %v; want no root group", pid, vm, id.gids)
				break
			}
		}
		for _, g := range id.groups {
			if g == 0 {
				t.Errorf("qemu %d of vm %s: supplementary groups %v include root", pid, vm, id.groups)
			}
		}
		ids[vm] = id
	}
	if t.Failed() {
		t.FailNow()
	}
	if ids["sand-a"].uids[0] == ids["sand-b"].uids[0] {
		t.Fatalf("both vms' qemu run as uid %d; want one uid per vm", ids["sand-a"].uids[0])
	}
	// The guests run (a dropped QEMU that cannot reach its files would not
	// boot them).
	waitConsole(t, a, "sand-a", `(?m)^tick 1\r?$`, 1)
	waitConsole(t, a, "sand-b", `(?m)^tick 1\r?$`, 1)

	dir := func(vm string) string { return filepath.Join(a.StateDir, "vms", vm) }
	// The check itself can say yes: QEMU can write its own disk (a
	// snapshot's new overlay is opened by QEMU after the drop, too).
	if !canAs(t, ids["sand-a"], "-w", filepath.Join(dir("sand-a"), "disk.qcow2")) {
		t.Fatalf("vm sand-a's qemu uid cannot write its own disk")
	}
	for _, c := range []struct{ op, path, what string }{
		{"-w", filepath.Join(dir("sand-b"), "disk.qcow2"), "write vm sand-b's disk"},
		{"-r", filepath.Join(dir("sand-b"), "disk.qcow2"), "read vm sand-b's disk"},
		{"-r", filepath.Join(dir("sand-b"), "console.log"), "read vm sand-b's console"},
		{"-w", filepath.Join(dir("sand-a"), "vm.json"), "write its own metadata"},
		{"-w", dir("sand-a"), "create files in its own directory"},
		{"-r", filepath.Join(a.StateDir, "identity.key"), "read the agent's identity key"},
	} {
		if canAs(t, ids["sand-a"], c.op, c.path) {
			t.Errorf("vm sand-a's qemu uid %d can %s (%s %s)", ids["sand-a"].uids[0], c.what, c.op, c.path)
		}
	}
	// The identity survives a stop and start, and a restart of the agent.
	if _, err := a.Client.Action(ctx, "sand-a", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	a.Restart(t)
	vm, err := a.Client.Action(ctx, "sand-a", agentapi.ActionStart)
	if err != nil {
		t.Fatal(err)
	}
	if got := readProcIdentity(t, vm.PID); got.uids[0] != ids["sand-a"].uids[0] {
		t.Fatalf("vm sand-a's qemu runs as uid %d after stop, restart and start; want %d as before", got.uids[0], ids["sand-a"].uids[0])
	}
}
