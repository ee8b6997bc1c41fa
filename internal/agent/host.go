package agent

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// hostCapacity is what this host has: its CPUs, its memory, and the size of
// the filesystem that holds the VMs' disks (the state directory's).
func hostCapacity(stateDir string) (agentapi.Resources, error) {
	r := agentapi.Resources{VCPUs: int64(runtime.NumCPU())}
	mem, err := memTotalMiB()
	if err != nil {
		return r, err
	}
	r.MemoryMiB = mem
	var st syscall.Statfs_t
	if err := syscall.Statfs(stateDir, &st); err != nil {
		return r, fmt.Errorf("statfs %s: %w", stateDir, err)
	}
	r.DiskMiB = int64(st.Blocks) * st.Bsize >> 20
	return r, nil
}

func memTotalMiB() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kib, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse /proc/meminfo MemTotal: %w", err)
			}
			return kib >> 10, nil
		}
	}
	return 0, fmt.Errorf("no MemTotal in /proc/meminfo")
}
