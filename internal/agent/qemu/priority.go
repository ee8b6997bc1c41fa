package qemu

// Every QEMU runs below the agent: on a host full of busy guests the
// agent still answers at once (issue 31). Two mechanisms, because either
// may be missing:
//   - the nice value of QEMU and all its threads, set before QEMU runs its
//     first instruction (startNiced), which orders QEMU against the agent
//     where both share a cgroup (or where the host has no cgroup v2 cpu
//     controller, like this repository's CI machines). QEMU stays in the
//     agent's session (Boot): with autogroup (sched(7), on in Debian's
//     kernels) nice values count only among the tasks of one session;
//     a session of its own would weigh each QEMU like the whole agent;
//   - with cgroups (cgroup.go), the cpu.weight of each VM's cgroup and of
//     their parent: CFS weighs whole cgroups against each other, so the
//     nice value of a task counts only inside its own cgroup. The same
//     nice value is written as cpu.weight.nice, the kernel's nice-to-weight
//     table: kvmd-vms weighs like one task at the VM nice value against the
//     agent's cgroup, and each VM's cgroup like its QEMU against the others
//     (a warm boot below the user VMs).

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// DefaultNice is the nice value QEMU runs at unless Options.Nice says
// otherwise: under the agent's 0, a nice-5 thread weighs 335 against
// 1024, so a busy guest thread gets under a quarter of a core the agent
// wants, and an idle agent leaves every cycle to the guests.
const DefaultNice = 5

// nice is the nice value a boot starts QEMU at: the boot's own (a warm
// boot, below user VMs), else the driver's; -1: the agent's own.
func (d *Driver) nice(opts agent.BootOptions) int {
	if opts.Nice > 0 {
		return opts.Nice
	}
	if d.opts.Nice < 0 {
		return -1
	}
	return d.opts.Nice
}

// VMNice is the nice value of user VMs' QEMUs: a warm VM handed over gets
// it back (agent.WarmDriver).
func (d *Driver) VMNice() int { return max(d.opts.Nice, 0) }

// startNiced runs start, which forks QEMU, on an OS thread of its own
// whose nice value is nice (none when negative). Linux keeps a nice value
// per thread and a forked process, like every thread it makes, copies its
// parent thread's: QEMU runs at nice from its first instruction, and so do
// its vCPU and I/O threads. A setpriority after the start would race them:
// threads QEMU made before it keep the agent's priority, and its thread
// list changes while it is read. A niced wrapper (nice -n) would do the
// same at the cost of an exec and of a command line that names another
// program until it execs QEMU.
//
// The thread takes its own priority back after the start and returns to
// the runtime's pool. It must not end: a process that another goroutine
// once started from it with a parent-death signal (Pdeathsig, which the
// kernel ties to the parent thread, not the process) would be killed with
// it; the terraform CLI run by terraform-exec in a test process that also
// runs an agent was. Only a thread that cannot take its priority back (an
// agent without CAP_SYS_NICE) is left locked, so that the runtime ends it
// rather than run other goroutines below the agent. When the thread cannot
// take the VMs' nice value at all (an agent without CAP_SYS_NICE that runs
// niced itself above it), QEMU starts at the agent's own, logged.
func (d *Driver) startNiced(vm string, nice int, start func() error) error {
	if nice < 0 {
		return start()
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		tid := unix.Gettid()
		// The kernel's getpriority answers 20 - nice.
		prev, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
		if err != nil {
			runtime.UnlockOSThread()
			d.log.Warn("qemu starts at the agent's own priority", "vm", vm, "nice", nice, "err", err)
			errc <- start()
			return
		}
		niced := unix.Setpriority(unix.PRIO_PROCESS, tid, nice)
		if niced != nil {
			d.log.Warn("qemu starts at the agent's own priority", "vm", vm, "nice", nice, "err", niced)
		}
		errc <- start()
		if niced != nil {
			runtime.UnlockOSThread()
			return
		}
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, 20-prev); err != nil {
			d.log.Warn("a thread that started qemu cannot take the agent's priority back; it ends", "vm", vm, "err", err)
			return // still locked: the runtime ends the thread
		}
		runtime.UnlockOSThread()
	}()
	return <-errc
}

// SetNice sets the nice value of every thread of m's QEMU (threads started
// later inherit it), and where VMs have cgroups the cpu.weight.nice of its
// cgroup. Raising the priority needs CAP_SYS_NICE.
func (d *Driver) SetNice(m *agent.Machine, nice int) error {
	if alive, why := checkProcess(m.Process, pidfileOf(m)); !alive {
		return fmt.Errorf("set priority of vm %s: %s", m.ID, why)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", m.Process.PID))
	if err != nil {
		return fmt.Errorf("set priority of vm %s: %w", m.ID, err)
	}
	var errs []error
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := syscall.Setpriority(syscall.PRIO_PROCESS, tid, nice); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("thread %d: %w", tid, err))
		}
	}
	launchDir := m.Process.LaunchDir
	if launchDir == "" {
		launchDir = m.Dir
	}
	if err := d.cg.setNice(launchDir, nice); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("set nice %d on qemu %d of vm %s: %w", nice, m.Process.PID, m.ID, err)
	}
	return nil
}
