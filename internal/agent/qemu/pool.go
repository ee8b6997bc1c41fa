package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// readyLine is the line a guest prints on its serial console once it is up
// (the busybox image of scripts/build-image.sh prints it): a warm VM is
// paused only after it.
const readyLine = "kvm-guest-ready"

// readyPoll is how often WaitReady reads the console.
const readyPoll = 10 * time.Millisecond

var _ agent.WarmDriver = (*Driver)(nil)

// WaitReady reads the console log as it grows until a line is the ready
// line. It fails early when QEMU exits.
func (d *Driver) WaitReady(ctx context.Context, m *agent.Machine) error {
	path := filepath.Join(m.Dir, consoleFileName)
	var off int64
	var partial []byte
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	for {
		chunk, err := readFrom(path, off)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("read console of vm %s: %w", m.ID, err)
		}
		off += int64(len(chunk))
		lines := bytes.Split(append(partial, chunk...), []byte("\n"))
		for _, l := range lines[:len(lines)-1] {
			if string(bytes.TrimRight(l, "\r")) == readyLine {
				return nil
			}
		}
		partial = lines[len(lines)-1]
		if alive, why := checkProcess(m.Process, pidfileOf(m)); !alive {
			return fmt.Errorf("vm %s: %s before its guest printed %s; see %s", m.ID, why, readyLine, path)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("vm %s: no %s line on its console (%s): %w", m.ID, readyLine, path, ctx.Err())
		case <-tick.C:
		}
	}
}

func readFrom(path string, off int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return nil, err
	}
	return io.ReadAll(f)
}

// Handover keeps naming the warm VM's QEMU after its directory moves: the
// pid file on its command line stays in the pool directory it was started
// in.
func (d *Driver) Handover(from, to *agent.Machine) error {
	to.Process = from.Process
	if to.Process.LaunchDir == "" {
		to.Process.LaunchDir = from.Dir
	}
	return nil
}

// KillOrphan ends the QEMU of a warm VM a previous agent left, found by its
// pid file, but only while that process still has its files open in m.Dir:
// a warm VM handed to a user moved its directory, and is never ended here.
func (d *Driver) KillOrphan(_ context.Context, m *agent.Machine) error {
	pidfile := pidfileOf(m)
	procs := findProcesses(pidfile)
	if alive, _ := checkProcess(m.Process, pidfile); alive {
		procs = append(procs, m.Process)
	}
	var errs []error
	for _, p := range procs {
		if !hasFilesUnder(p.PID, m.Dir) {
			d.log.Warn("qemu process of a pool entry left alone: its files are no longer in the pool directory",
				"warm_vm", m.ID, "pid", p.PID)
			continue
		}
		if err := killProcess(p, pidfile); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kill qemu of warm vm %s: %w", m.ID, err)
	}
	return nil
}

// hasFilesUnder tells whether process pid has a file open below dir. The
// kernel reports an open file's current path, so files that moved with
// their directory are reported where they are now.
func hasFilesUnder(pid int, dir string) bool {
	fds := fmt.Sprintf("/proc/%d/fd", pid)
	entries, err := os.ReadDir(fds)
	if err != nil {
		return false
	}
	prefix := filepath.Clean(dir) + "/"
	for _, e := range entries {
		if target, err := os.Readlink(filepath.Join(fds, e.Name())); err == nil && strings.HasPrefix(target, prefix) {
			return true
		}
	}
	return false
}

// ProcessesUnder returns the pids of the live QEMU processes whose pid file
// lies below dir (an agent's state directory): its VMs, warm or handed out.
// Tests use it to kill every guest they started.
func ProcessesUnder(dir string) []int {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil
	}
	var out []int
	for _, l := range qemuProcesses(func(pf string) bool { return strings.HasPrefix(pf, abs+"/") }) {
		out = append(out, l.process.PID)
	}
	return out
}

// handedOverTo matches the pid files of the QEMU of a VM in dir that
// started as a warm VM: its command line names a pool directory that now
// links to dir. Kill uses it when the metadata naming that directory
// (Process.LaunchDir) is lost, so that a delete still ends the process.
// It matches nothing when dir does not resolve.
func handedOverTo(dir string) func(pidfile string) bool {
	want, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return func(string) bool { return false }
	}
	return func(pf string) bool {
		launchDir := filepath.Dir(pf)
		if fi, err := os.Lstat(launchDir); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			return false
		}
		got, err := filepath.EvalSymlinks(launchDir)
		return err == nil && got == want
	}
}
