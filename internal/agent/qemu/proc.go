package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// procStat returns a process's state letter and start time (fields 3 and 22
// of /proc/<pid>/stat).
func procStat(pid int) (byte, uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) may hold spaces and parentheses: the
	// fields after it start after its last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 20 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(fields))
	}
	start, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat start time: %w", pid, err)
	}
	return fields[0][0], start, nil
}

func procCmdline(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || len(b) == 0 {
		return nil
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
}

// ownsPidfile tells whether a command line is that of the QEMU whose
// -pidfile is pidfile: the pid file path holds the VM's directory, so it
// names one VM of one agent.
func ownsPidfile(args []string, pidfile string) bool { return pidfileArg(args) == pidfile }

// checkProcess tells whether p is still the VM's live QEMU: the pid exists,
// is not a zombie, started when recorded, and runs with the VM's pid file.
// When not, it says why.
func checkProcess(p agent.Process, pidfile string) (bool, string) {
	if p.PID <= 0 {
		return false, "no qemu process is recorded"
	}
	state, start, err := procStat(p.PID)
	switch {
	case err != nil:
		return false, fmt.Sprintf("qemu process %d is gone", p.PID)
	case state == 'Z' || state == 'X':
		return false, fmt.Sprintf("qemu process %d has exited", p.PID)
	case p.StartTime != 0 && start != p.StartTime:
		return false, fmt.Sprintf("qemu process %d is gone (its pid now belongs to another process)", p.PID)
	case !ownsPidfile(procCmdline(p.PID), pidfile):
		return false, fmt.Sprintf("qemu process %d is gone (its pid now runs another program)", p.PID)
	}
	return true, ""
}

// waitGone waits until p is no longer the VM's live QEMU, or timeout: on
// the process's pidfd, which wakes the wait the moment it exits, and by
// polling where the kernel has no pidfds (before Linux 5.3).
func waitGone(p agent.Process, pidfile string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	if fd, err := unix.PidfdOpen(p.PID, 0); err == nil {
		defer func() { _ = unix.Close(fd) }()
		// Opened after p may have gone: exited (start time) tells whether
		// the pidfd is p's at all, before and after each wake.
		for !exited(p, pidfile) {
			left := time.Until(deadline)
			if left <= 0 {
				return false
			}
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(fds, int(left.Milliseconds())+1)
			if err != nil && !errors.Is(err, unix.EINTR) {
				break // poll below
			}
			if n > 0 && !exited(p, pidfile) {
				time.Sleep(time.Millisecond) // exited, not yet reaped in /proc's view
			}
		}
		if exited(p, pidfile) {
			return true
		}
	}
	for {
		if exited(p, pidfile) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// exited says whether p has really ended. While a process exits, its
// command line reads empty before it becomes a zombie, so once the start
// time is known (it tells a reused pid apart), only the pid and the start
// time decide: a blank command line of the same process is still exiting.
func exited(p agent.Process, pidfile string) bool {
	if p.StartTime == 0 {
		alive, _ := checkProcess(p, pidfile)
		return !alive
	}
	state, start, err := procStat(p.PID)
	return err != nil || state == 'Z' || state == 'X' || start != p.StartTime
}

// ProcessesOf returns the pids of the live QEMU processes of the VM whose
// directory is dir, found by their command line (-pidfile <dir>/qemu.pid).
// Tests use it to kill every guest they started.
func ProcessesOf(dir string) []int {
	var out []int
	for _, p := range findProcesses(filepath.Join(dir, pidFileName)) {
		out = append(out, p.PID)
	}
	return out
}

func findProcesses(pidfile string) []agent.Process {
	var out []agent.Process
	for _, l := range qemuProcesses(func(pf string) bool { return pf == pidfile }) {
		out = append(out, l.process)
	}
	return out
}

// launched is a QEMU process and the pid file its command line names.
type launched struct {
	process agent.Process
	pidfile string
}

// qemuProcesses lists the live (not zombie) processes whose command line
// has a -pidfile that match accepts: how the driver finds QEMUs that its
// metadata does not name (every VM's pid file path holds its directory).
func qemuProcesses(match func(pidfile string) bool) []launched {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []launched
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		pf := pidfileArg(procCmdline(pid))
		if pf == "" || !match(pf) {
			continue
		}
		if state, start, err := procStat(pid); err == nil && state != 'Z' && state != 'X' {
			out = append(out, launched{agent.Process{PID: pid, StartTime: start}, pf})
		}
	}
	return out
}

// pidfileArg is the value of -pidfile on a command line, or "".
func pidfileArg(args []string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-pidfile" {
			return args[i+1]
		}
	}
	return ""
}

func killProcess(p agent.Process, pidfile string) error {
	if alive, _ := checkProcess(p, pidfile); !alive {
		return nil
	}
	if err := syscall.Kill(p.PID, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill qemu process %d: %w", p.PID, err)
	}
	if !waitGone(p, pidfile, 10*time.Second) {
		return fmt.Errorf("qemu process %d still runs 10s after SIGKILL", p.PID)
	}
	return nil
}
