package qemu

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestStartNicedHandsTheThreadBack: the thread that started a QEMU at the
// VMs' nice value takes its own priority back and returns to the runtime's
// pool, alive. Were it ended instead, every process another goroutine had
// started from that thread with a parent-death signal (Pdeathsig: the
// terraform CLI under terraform-exec, for one, in a process that also runs
// an agent) would be killed with it.
func TestStartNicedHandsTheThreadBack(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a thread takes back a higher priority only with CAP_SYS_NICE (root)")
	}
	d := &Driver{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	before := niceOfThread(t, unix.Gettid())
	// Several starts: one may run on the main thread, which the runtime
	// parks rather than ends.
	var tids []int
	for range 10 {
		if err := d.startNiced("vm", DefaultNice, func() error {
			tid := unix.Gettid()
			tids = append(tids, tid)
			if n := niceOfThread(t, tid); n != DefaultNice {
				return fmt.Errorf("the starting thread runs at nice %d, want %d", n, DefaultNice)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	// A thread that ends goes from /proc/self/task at once; give it time.
	time.Sleep(300 * time.Millisecond)
	for _, tid := range tids {
		if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid)); err != nil {
			t.Fatalf("thread %d that started a vm ended (%v): children it started with a parent-death signal die with it", tid, err)
		}
		if n := niceOfThread(t, tid); n != before {
			t.Fatalf("thread %d runs at nice %d after the start, want the agent's %d back", tid, n, before)
		}
	}
}

// TestStartNicedKillsNoOtherChild: processes that other goroutines started
// with a parent-death signal outlive many QEMU starts (the failure the test
// above pins down, as terraform met it: "signal: killed").
func TestStartNicedKillsNoOtherChild(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a thread takes back a higher priority only with CAP_SYS_NICE (root)")
	}
	d := &Driver{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	const children = 8
	cmds := make([]*exec.Cmd, children)
	var wg sync.WaitGroup
	for i := range cmds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := exec.Command("sleep", "60")
			c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			if err := c.Start(); err != nil {
				t.Error(err)
				return
			}
			cmds[i] = c
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range cmds {
			if c != nil {
				_ = c.Process.Kill()
				_ = c.Wait()
			}
		}
	})
	for range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.Gosched()
			if err := d.startNiced("vm", DefaultNice, func() error { return nil }); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	time.Sleep(300 * time.Millisecond)
	for _, c := range cmds {
		if c == nil {
			continue
		}
		if err := c.Process.Signal(syscall.Signal(0)); err != nil {
			t.Fatalf("child %d was killed during the starts: %v", c.Process.Pid, err)
		}
		var ws syscall.WaitStatus
		if pid, err := syscall.Wait4(c.Process.Pid, &ws, syscall.WNOHANG, nil); err != nil && !errors.Is(err, syscall.ECHILD) || pid != 0 {
			t.Fatalf("child %d was killed during the starts: %v", c.Process.Pid, ws)
		}
	}
}

func niceOfThread(t *testing.T, tid int) int {
	t.Helper()
	prio, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		t.Fatal(err)
	}
	return 20 - prio
}
