// Package qemu is the real VMM driver of the host agent: one
// qemu-system-x86_64 process per VM, started detached (a process group of
// its own) so that it outlives an agent restart, sandboxed (sandbox.go), and driven over
// QMP on a unix socket in the VM's directory.
//
// A VM's directory holds:
//
//	disk.qcow2   its disk: a qcow2 overlay on the image's disk, or a blank one
//	             (a child's: on a snapshot's frozen disk, see snapshot.go)
//	disk.N.qcow2 the overlay that snapshot N put on top of the one before;
//	             the VM's metadata (Machine.Disk) names the one it writes
//	console.log  the serial console (appended across boots, capped: console.go)
//	qemu.log     QEMU's own output (its errors)
//	qemu.uid     the uid QEMU runs as (sandbox.go)
//	qmp.sock     the QMP monitor socket
//	qga.sock     the guest agent channel's socket, for a VM with guest_agent
//	             (qga.go)
//	qemu.pid     QEMU's pid file; its path on QEMU's command line names the VM
//	efivars.fd   a uefi VM's UEFI variables (firmware.go)
package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	diskFileName    = "disk.qcow2"
	consoleFileName = "console.log"
	qmpFileName     = "qmp.sock"
	pidFileName     = "qemu.pid"
	qemuLogFileName = "qemu.log"
	// startTimeout bounds QEMU's own start (until its monitor answers),
	// not the guest's boot.
	startTimeout = 60 * time.Second
)

// Options configures the driver.
type Options struct {
	ImageDir string // one folder per image, each with an image.json
	// CacheDir holds the agent's cache of registered images
	// (CacheDir/sha256/<hex>, named "sha256:<hex>"); default ImageDir.
	CacheDir string
	Accel    string       // auto (default), kvm or tcg
	QEMU     string       // default qemu-system-x86_64
	QEMUImg  string       // default qemu-img
	Logger   *slog.Logger // default slog.Default()
	// Passt is the passt binary of user-mode NICs (default passt).
	Passt string
	// UserNetUser is the user passt runs as when the agent is root
	// (default DefaultUserNetUser; nobody when that user is missing).
	UserNetUser string
	// UserNetAllow are private or link-local ranges that user-mode guests
	// may reach (network.UserNetBlocked lists what they may not).
	UserNetAllow []netip.Prefix
	// UIDBase and UIDCount are the uids (and gids of the same numbers)
	// the agent, when root, runs its VMs' QEMU processes as, one per VM
	// (sandbox.go); defaults DefaultUIDBase and DefaultUIDCount. They
	// must belong to no user of the host.
	UIDBase, UIDCount uint32
	// ConsoleLogBytes caps each VM's console log (console.go); default
	// DefaultConsoleLogBytes. ConsoleTrimInterval is how often the agent
	// trims the logs that outgrew it; default 1s.
	ConsoleLogBytes     int64
	ConsoleTrimInterval time.Duration
	// OVMFDir holds the UEFI firmware of uefi VMs (firmware.go); default
	// DefaultOVMFDir, where Debian's ovmf package puts it.
	OVMFDir string
	// Nice is the nice value every QEMU starts at (priority.go); default
	// DefaultNice; negative: the agent's own.
	Nice int
}

// Driver runs VMs with QEMU.
type Driver struct {
	opts      Options
	qemu      string
	qemuImg   string
	accel     string
	accelNote string
	log       *slog.Logger
	// snapshotPauses counts the VM pauses of snapshots (snapshot.go).
	snapshotPauses atomic.Int64
	// qmpSessions counts the QMP sessions opened (qmp.go).
	qmpSessions atomic.Int64
	// earlyStarts counts the children started while their snapshot was
	// still being pulled (StartSpawn in snapshot.go).
	earlyStarts atomic.Int64
	// net makes the host side of NICs (taps, bridges, leases, NAT rules);
	// ports are the host ports of user-mode forwards (network.go).
	net   *network.Host
	ports hostPorts
	// usernet runs user-mode NICs (passt.go).
	usernet *userNet
	// cg puts each QEMU in a cgroup of its own (cgroup.go).
	cg *cgroups
	// runAs: the agent is root and runs each QEMU as its VM's uid
	// (sandbox.go). uidMu guards the uid registry, uidNext (where the next
	// search for a free uid starts) and searchable (directories known to
	// let QEMU's uids through).
	runAs bool
	// incoming holds the agent's end of each incoming VM's stream socket
	// pair until its memory channel arrives (migrate.go).
	incomingMu sync.Mutex
	incoming   map[string]*os.File
	uidMu      sync.Mutex
	uidNext    uint32
	searchable map[string]bool
	// consoles are the console logs of running QEMUs, by pid, that the
	// trimmer (running while trimming is set) keeps within their cap
	// (console.go); consoleMu guards them and every write of a log.
	consoleMu sync.Mutex
	consoles  map[int]consoleWatch
	trimming  bool
	// qgaLocks hold one guest agent session per VM at a time (qga_vm.go),
	// under qgaMu; qga counts what the guest agents did.
	qgaMu    sync.Mutex
	qgaLocks map[string]*sync.Mutex
	qga      guestAgentStats
}

var _ agent.Driver = (*Driver)(nil)

// New finds QEMU and picks the accelerator: with auto, KVM only when a probe
// guest really runs under it (nested KVM may open and then hang guests).
func New(ctx context.Context, opts Options) (*Driver, error) {
	d := &Driver{opts: opts, qemu: opts.QEMU, qemuImg: opts.QEMUImg, log: opts.Logger, searchable: map[string]bool{},
		consoles: map[int]consoleWatch{}}
	if d.opts.ConsoleLogBytes == 0 {
		d.opts.ConsoleLogBytes = DefaultConsoleLogBytes
	}
	if d.opts.ConsoleLogBytes < 64<<10 {
		return nil, fmt.Errorf("qemu driver: console log cap %d bytes: want at least 64 KiB", d.opts.ConsoleLogBytes)
	}
	if d.opts.ConsoleTrimInterval <= 0 {
		d.opts.ConsoleTrimInterval = defaultTrimInterval
	}
	if d.opts.OVMFDir == "" {
		d.opts.OVMFDir = DefaultOVMFDir
	}
	if d.opts.Nice == 0 {
		d.opts.Nice = DefaultNice
	}
	if d.opts.Nice > 19 {
		return nil, fmt.Errorf("qemu driver: nice %d: want at most 19", d.opts.Nice)
	}
	if d.opts.UIDCount == 0 {
		d.opts.UIDBase, d.opts.UIDCount = DefaultUIDBase, DefaultUIDCount
	}
	if d.opts.UIDBase == 0 || uint64(d.opts.UIDBase)+uint64(d.opts.UIDCount) > 1<<32-2 {
		return nil, fmt.Errorf("qemu driver: uids %d to %d: want above 0 and below 4294967294", d.opts.UIDBase, uint64(d.opts.UIDBase)+uint64(d.opts.UIDCount)-1)
	}
	if d.qemu == "" {
		d.qemu = "qemu-system-x86_64"
	}
	if d.qemuImg == "" {
		d.qemuImg = "qemu-img"
	}
	if d.log == nil {
		d.log = slog.Default()
	}
	d.net = network.New(d.log)
	d.usernet = newUserNet(opts, d.log)
	var err error
	if d.qemu, err = exec.LookPath(d.qemu); err != nil {
		return nil, fmt.Errorf("qemu driver: %w: install qemu-system-x86", err)
	}
	if d.qemuImg, err = exec.LookPath(d.qemuImg); err != nil {
		return nil, fmt.Errorf("qemu driver: %w: install qemu-utils", err)
	}
	if opts.ImageDir != "" {
		abs, err := filepath.Abs(opts.ImageDir)
		if err != nil {
			return nil, fmt.Errorf("qemu driver: image directory: %w", err)
		}
		d.opts.ImageDir = abs
		if _, err := os.Stat(abs); err != nil {
			return nil, fmt.Errorf("qemu driver: image directory: %w (build one with make image)", err)
		}
	}
	d.accel, d.accelNote, err = chooseAccel(ctx, d.qemu, opts.Accel, probeKernel(d.opts.ImageDir))
	if err != nil {
		return nil, fmt.Errorf("qemu driver: %w", err)
	}
	d.log.Info("qemu accelerator chosen", "accel", d.accel, "why", d.accelNote, "qemu", d.qemu)
	d.cg = detectCgroups("/proc/self/mounts", os.Geteuid(), max(d.opts.Nice, 0), d.log)
	d.runAs = os.Geteuid() == 0
	if d.runAs {
		// QEMU needs no IP socket of its own (taps and passt come as
		// descriptors): one that a guest took over reaches nothing, not
		// even the host's loopback.
		if err := network.FenceQEMU(d.opts.UIDBase, d.opts.UIDBase+d.opts.UIDCount-1); err != nil {
			return nil, fmt.Errorf("qemu driver: %w (the agent refuses to run qemu as root-started uids that could reach the host's loopback; check that nftables works here)", err)
		}
		d.log.Info("qemu runs sandboxed, as a uid of its vm", "sandbox", qemuSandbox,
			"uids", fmt.Sprintf("%d-%d", d.opts.UIDBase, d.opts.UIDBase+d.opts.UIDCount-1))
	} else {
		d.log.Warn("the agent is not root: qemu runs sandboxed but as the agent's own user, which owns every vm's files",
			"sandbox", qemuSandbox, "uid", os.Geteuid())
	}
	return d, nil
}

// Name is "qemu".
func (d *Driver) Name() string { return "qemu" }

// Isolation says how each VM is held to its shape (agent.Isolator).
func (d *Driver) Isolation() string { return d.cg.note }

// Accel is kvm or tcg, and why.
func (d *Driver) Accel() (string, string) { return d.accel, d.accelNote }

// CheckSpec refuses less memory than the image needs to boot, and a
// firmware that cannot boot the image's disk (firmware.go).
func (d *Driver) CheckSpec(spec agentapi.VMSpec, img agent.Image) error {
	m, err := d.loadImage(img.Name)
	if err != nil {
		return err
	}
	min := m.MinMemoryMiB
	if min == 0 {
		min = 64
	}
	if spec.MemoryMiB < min {
		return agent.ErrInvalidSpec("memory_mib %d is too small for image %s: it needs at least %d", spec.MemoryMiB, img.Name, min)
	}
	if err := d.checkBootFirmware(spec, m); err != nil {
		return err
	}
	return d.checkNICs(spec.NICs)
}

// pidfileOf is the pid file on the command line of m's QEMU: in the
// directory it was started in, which a warm VM handed to a new id left
// (Process.LaunchDir).
func pidfileOf(m *agent.Machine) string {
	if m.Process.LaunchDir != "" {
		return filepath.Join(m.Process.LaunchDir, pidFileName)
	}
	return filepath.Join(m.Dir, pidFileName)
}
func qmpPathOf(m *agent.Machine) string { return filepath.Join(m.Dir, qmpFileName) }

// Create makes the VM's disk: a qcow2 overlay of disk_mib on the image's
// disk, or a blank qcow2 when the image has none. An existing disk is kept.
func (d *Driver) Create(ctx context.Context, m *agent.Machine) error {
	img, err := d.loadImage(m.Image)
	if err != nil {
		return err
	}
	if firmwareOf(m, img) == agentapi.FirmwareUEFI {
		_, template := d.ovmf(m.SecureBoot)
		if err := ensureVars(m, template); err != nil {
			return err
		}
	}
	if m.DiskMiB == 0 {
		return nil
	}
	disk := diskPath(m)
	if _, err := os.Stat(disk); err == nil {
		return nil
	} else if m.Disk != "" {
		return fmt.Errorf("disk %s of vm %s: %w; its disk chain is broken", disk, m.ID, err)
	}
	tmp := disk + ".tmp"
	args := []string{"create", "-q", "-f", "qcow2"}
	if img.Disk != "" {
		args = append(args, "-b", d.path(img, img.Disk), "-F", img.EffectiveDiskFormat())
	}
	args = append(args, tmp, strconv.FormatInt(m.DiskMiB, 10)+"M")
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, d.qemuImg, args...).CombinedOutput(); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("qemu-img create disk of vm %s: %w: %s", m.ID, err, bytes.TrimSpace(out))
	}
	// Renamed into place only when complete, so a crash never leaves a
	// half-made disk that a retry would keep.
	return os.Rename(tmp, disk)
}

// args is QEMU's command line for m. Its RAM is a memfd that QEMU maps
// shared (the object "ram"), so that a snapshot can copy it out without
// putting it through the migration stream (snapshot.go); or, for a child
// started from a RAM image, that file mapped copy-on-write: the child
// faults pages in as it touches them instead of loading them all first.
//
// child, for a VM started from a snapshot, says where that snapshot's
// files are when QEMU starts (see childFiles).
//
// uid is the uid QEMU drops to once set up (0: it keeps the agent's).
func (d *Driver) args(m *agent.Machine, img *image, opts agent.BootOptions, child childFiles, nics []string, uid uint32) []string {
	cpu := "max"
	if d.accel == "kvm" {
		cpu = "host"
	}
	fwMachine, fwArgs := d.firmwareArgs(m, img)
	args := []string{
		// The VM id in -name lets an operator find its process with ps.
		"-name", "guest=" + m.ID + ",debug-threads=on",
		"-machine", img.Machine + ",memory-backend=" + ramObjectID + fwMachine, "-accel", d.accel, "-cpu", cpu,
		"-smp", strconv.FormatInt(m.VCPUs, 10), "-m", strconv.FormatInt(m.MemoryMiB, 10) + "M",
		"-object", ramObject(m.MemoryMiB, child.ram),
		"-nodefaults", "-no-user-config", "-display", "none",
		"-chardev", "file,id=console,append=on,path=" + qemuOptQuote(filepath.Join(m.Dir, consoleFileName)),
		"-serial", "chardev:console",
		// Relative to QEMU's working directory (the VM's): a unix socket
		// path is limited to 108 bytes, a state directory is not.
		"-chardev", "socket,id=qmp,server=on,wait=off,path=" + qemuOptQuote(qmpFileName),
		"-mon", "chardev=qmp,mode=control",
		"-pidfile", pidfileOf(m),
	}
	args = append(args, sandboxArgs(uid)...)
	args = append(args, fwArgs...)
	blk := "virtio-blk-pci"
	if img.Machine == "microvm" {
		blk = "virtio-blk-device"
	} else {
		// vmgenid tells a guest that it was cloned (forks). Only q35/pc
		// describe it in their ACPI tables: microvm's ACPI builder
		// (hw/i386/acpi-microvm.c in QEMU 7.2) has no vmgenid entry, so the
		// device would be invisible to the guest there and is left out.
		args = append(args, "-device", "vmgenid,guid=auto")
	}
	if img.Kind == agent.ImageKernel {
		args = append(args, "-kernel", d.path(img, img.Kernel))
		if img.Initrd != "" {
			args = append(args, "-initrd", d.path(img, img.Initrd))
		}
		if img.Cmdline != "" {
			args = append(args, "-append", img.Cmdline)
		}
	}
	if m.DiskMiB > 0 {
		drive := "if=none,id=disk0,format=qcow2,discard=unmap,file=" + qemuOptQuote(diskPath(m))
		if child.backing != "" {
			// The frozen disk is opened where it is now; the overlay's
			// header keeps naming it where it will be.
			drive += ",backing.file.filename=" + qemuOptQuote(child.backing)
		}
		dev := blk + ",drive=disk0"
		if img.Kind == agent.ImageDisk {
			dev += ",bootindex=0"
		}
		args = append(args, "-drive", drive, "-device", dev)
	}
	if m.Seed != "" {
		// The NoCloud seed, read-only, after the VM's own disk (which stays
		// vda): cloud-init finds it by its label on any block device.
		drive := "if=none,id=seed,format=raw,readonly=on,file=" + qemuOptQuote(filepath.Join(m.Dir, m.Seed))
		args = append(args, "-drive", drive, "-device", blk+",drive=seed")
	}
	args = append(args, nics...)
	if m.GuestAgent {
		args = append(args, qgaArgs(img.Machine == "microvm")...)
	}
	args = append(args, volumeArgs(m, img)...)
	if opts.Paused || opts.Incoming != "" {
		args = append(args, "-S")
	}
	if opts.Incoming != "" {
		// The state is loaded by QMP (Spawn), once the migration
		// capabilities are set: the events that tell it is loaded, and
		// x-ignore-shared with a RAM image.
		args = append(args, "-incoming", "defer")
	}
	return args
}

// ramObjectID is the id of the memory backend that holds a VM's RAM.
const ramObjectID = "ram"

// ramObject is the -object of a VM's RAM: a memfd, or ramImage mapped
// privately (copy-on-write).
func ramObject(memMiB int64, ramImage string) string {
	size := strconv.FormatInt(memMiB, 10) + "M"
	if ramImage != "" {
		return "memory-backend-file,id=" + ramObjectID + ",size=" + size + ",share=off,mem-path=" + qemuOptQuote(ramImage)
	}
	return "memory-backend-memfd,id=" + ramObjectID + ",size=" + size + ",share=on"
}

// qemuOptQuote escapes a value for a QEMU option list (-object, -drive,
// -chardev), where a comma is written as two: every option value built
// from a path goes through it, or a comma in a state directory would start
// a new option.
func qemuOptQuote(v string) string { return strings.ReplaceAll(v, ",", ",,") }

// Boot starts QEMU detached, in a process group of its own (not a child
// that dies with the agent), and returns once its QMP monitor answers.
func (d *Driver) Boot(ctx context.Context, m *agent.Machine, opts agent.BootOptions) error {
	q, err := d.boot(ctx, m, opts, childFiles{})
	if err != nil {
		return err
	}
	return q.Close()
}

// childFiles are the files of the snapshot a child starts from, where
// QEMU opens them: ram, the RAM image to map ("" for a memfd), and
// backing, the frozen disk under the child's overlay when it is not (yet)
// where the overlay's header names it ("" to follow the header): a
// snapshot still being pulled (StartSpawn).
type childFiles struct{ ram, backing string }

// boot is Boot, with the RAM of m mapped from child.ram when it is set. It
// returns the QMP session that checked the new QEMU, for the caller to go
// on with or close.
func (d *Driver) boot(ctx context.Context, m *agent.Machine, opts agent.BootOptions, child childFiles) (*monitor, error) {
	t0 := time.Now()
	img, err := d.loadImage(m.Image)
	if err != nil {
		return nil, err
	}
	if alive, _ := checkProcess(m.Process, pidfileOf(m)); alive {
		return nil, fmt.Errorf("boot vm %s: qemu process %d still runs", m.ID, m.Process.PID)
	}
	for _, p := range findProcesses(pidfileOf(m)) {
		return nil, fmt.Errorf("boot vm %s: an earlier qemu process %d of it still runs; delete the vm", m.ID, p.PID)
	}
	// A new process, started in m.Dir.
	m.Process = agent.Process{}
	// Leftovers of an earlier run would confuse the checks below.
	_ = os.Remove(qmpPathOf(m))
	_ = os.Remove(pidfileOf(m))
	_ = os.Remove(qgaPathOf(m))
	// A new boot is not frozen, whatever the last one was.
	_ = os.Remove(filepath.Join(m.Dir, frozenMarkerName))

	nics, netns, files, err := d.attachNICs(m, img)
	if err != nil {
		return nil, fmt.Errorf("boot vm %s: %w", m.ID, err)
	}
	defer closeAll(files)

	if err := d.markBoot(m); err != nil {
		return nil, fmt.Errorf("boot vm %s: %w", m.ID, err)
	}
	var uid uint32
	if d.runAs {
		if uid, err = d.vmUID(m); err == nil {
			err = d.prepareFiles(m, uid)
		}
		if err != nil {
			return nil, fmt.Errorf("boot vm %s: %w", m.ID, err)
		}
	}

	// The start must finish even when the caller gives up: a half-started
	// QEMU that nobody records is worse than a finished one.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), startTimeout)
	defer cancel()
	// QEMU's stdout and stderr: its own errors at start, and what it warns
	// of later (trimmed with the console log).
	logPath := filepath.Join(m.Dir, qemuLogFileName)
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o640)
	if err != nil {
		return nil, fmt.Errorf("boot vm %s: %w", m.ID, err)
	}
	// Not a CommandContext: QEMU outlives this call (and the agent).
	cmd := exec.Command(d.qemu, d.args(m, img, opts, child, nics, uid)...)
	cmd.Dir = m.Dir
	cmd.ExtraFiles = files
	cmd.Stdout, cmd.Stderr = logf, logf
	// A process group of its own: no signal for the agent's group (a
	// terminal's ^C) reaches it. Not a session of its own: where the
	// kernel groups tasks by session (autogroup, on when no cgroup weighs
	// them), a new session is a new group as heavy as the agent's whole
	// session, and QEMU's nice value would count only inside it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	nice := d.nice(opts)
	// Started inside its own cgroup: QEMU never runs, nor allocates,
	// outside its limits.
	if fd := d.cg.prepare(m.Dir, vmShape{m.ID, m.VCPUs, m.MemoryMiB, nice}, d.accel == "tcg"); fd >= 0 {
		defer func() { _ = syscall.Close(fd) }()
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
	}
	t1 := time.Now()
	// A forked child's QEMU runs in the child's network namespace (its
	// taps are there); every QEMU at its nice value from its first
	// instruction (startNiced).
	err = d.startNiced(m.ID, nice, func() error { return network.RunIn(netns, cmd.Start) })
	_ = logf.Close()
	if err != nil {
		d.killLeftovers(m)
		return nil, fmt.Errorf("start qemu for vm %s: %w", m.ID, err)
	}
	// The agent's child, in a process group of its own (not -daemonize: QEMU 7.2
	// sets its seccomp filter first, and spawn=deny forbids the fork). It
	// is reaped here while this agent runs; after an agent restart it is
	// init's.
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	pid := cmd.Process.Pid
	failed := func(err error) (*monitor, error) {
		_ = cmd.Process.Kill()
		d.killLeftovers(m)
		b, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("start qemu for vm %s: %w: %s", m.ID, err, strings.TrimSpace(string(b)))
	}
	_, start, err := procStat(pid)
	if err != nil {
		return failed(err)
	}
	m.Process = agent.Process{PID: pid, StartTime: start}
	d.watchConsole(m)
	t2 := time.Now()
	q, err := d.awaitMonitor(ctx, sctx, m, exited)
	if err != nil {
		return failed(err)
	}
	st, err := q.queryStatus(ctx)
	if err != nil {
		_ = q.Close()
		return failed(err)
	}
	// QEMU has connected to its passt processes by now: one that died
	// meanwhile fails the start with its own log.
	if err := checkPassts(m.Dir, m.NICs); err != nil {
		_ = q.Close()
		return failed(err)
	}
	d.log.Info("qemu started", "vm", m.ID, "pid", pid, "status", st.Status, "accel", d.accel, "nice", nice,
		"prepare_ms", t1.Sub(t0).Milliseconds(), "exec_ms", t2.Sub(t1).Milliseconds(), "qmp_ms", time.Since(t2).Milliseconds())
	return q, nil
}

func (d *Driver) killLeftovers(m *agent.Machine) {
	defer stopPassts(m.Dir)
	for _, p := range findProcesses(pidfileOf(m)) {
		if err := killProcess(p, pidfileOf(m)); err != nil {
			d.log.Error("kill qemu of a failed boot", "vm", m.ID, "pid", p.PID, "err", err)
		}
	}
}

// Shutdown asks the guest to power off, waits up to grace, then tells QEMU
// to quit, then kills it; the VM's cgroup goes with its process, whichever
// way it ended. A VM with the guest agent channel is asked
// through its guest agent first (guest-shutdown) when it answers, and
// given grace to power off; the ACPI power button follows when it answers
// not, or when the guest still runs after grace. A guest that ignores
// ACPI (a busybox init without a handler) ends by the quit after grace.
func (d *Driver) Shutdown(ctx context.Context, m *agent.Machine, grace time.Duration) error {
	pidfile := pidfileOf(m)
	if alive, _ := checkProcess(m.Process, pidfile); !alive {
		return d.Kill(ctx, m) // only leftovers found by command line, if any
	}
	if m.GuestAgent && d.running(ctx, m) && d.shutdownThroughAgent(ctx, m) {
		if waitGone(m.Process, pidfile, grace) {
			d.log.Info("guest powered off", "vm", m.ID, "through", "guest agent")
			d.cg.remove(m.Dir, m.Process.LaunchDir)
			return nil
		}
		d.log.Warn("guest still runs after its guest agent took the shutdown; pressing the acpi power button", "vm", m.ID, "grace", grace)
	}
	var st qmpStatus
	qerr := d.withMonitor(ctx, m, func(q *monitor) error {
		var err error
		st, err = q.queryStatus(ctx)
		// A paused guest cannot see the power button: go straight to quit.
		if err == nil && st.Running {
			if err := q.powerdown(ctx); err != nil {
				d.log.Warn("acpi power-down failed", "vm", m.ID, "err", err)
			}
		}
		return err
	})
	if qerr == nil && st.Running && waitGone(m.Process, pidfile, grace) {
		d.log.Info("guest powered off", "vm", m.ID)
		d.cg.remove(m.Dir, m.Process.LaunchDir)
		return nil
	}
	if err := d.withMonitor(ctx, m, func(q *monitor) error { return q.quit(ctx) }); err != nil {
		d.log.Warn("qmp quit failed", "vm", m.ID, "err", err)
	}
	if waitGone(m.Process, pidfile, 5*time.Second) {
		d.log.Info("qemu quit", "vm", m.ID, "after_acpi_timeout", qerr == nil && st.Running)
		d.cg.remove(m.Dir, m.Process.LaunchDir)
		return nil
	}
	return d.Kill(ctx, m)
}

// Kill ends QEMU at once.
func (d *Driver) Kill(_ context.Context, m *agent.Machine) error {
	d.dropIncoming(m.ID)
	var errs []error
	pidfile := pidfileOf(m)
	if err := killProcess(m.Process, pidfile); err != nil {
		errs = append(errs, err)
	}
	// Any other QEMU of m's pid file, and a warm VM handed to m whose
	// metadata no longer names its pool directory (pool.go): one pass over
	// /proc finds both.
	launchDirs := []string{m.Dir, m.Process.LaunchDir}
	handed := handedOverTo(m.Dir)
	for _, l := range qemuProcesses(func(pf string) bool { return pf == pidfile || handed(pf) }) {
		if err := killProcess(l.process, l.pidfile); err != nil {
			errs = append(errs, err)
		}
		if l.pidfile != pidfile {
			launchDirs = append(launchDirs, filepath.Dir(l.pidfile))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kill qemu of vm %s: %w", m.ID, err)
	}
	d.cg.remove(launchDirs...)
	return nil
}

// Pause stops the vCPUs (QMP stop).
func (d *Driver) Pause(ctx context.Context, m *agent.Machine) error {
	return d.withMonitor(ctx, m, func(q *monitor) error { return q.stop(ctx) })
}

// Resume continues the vCPUs (QMP cont), and thaws the guest's file
// systems when a snapshot that kept the VM paused froze them.
func (d *Driver) Resume(ctx context.Context, m *agent.Machine) error {
	if err := d.withMonitor(ctx, m, func(q *monitor) error { return q.cont(ctx) }); err != nil {
		return err
	}
	if m.GuestAgent {
		d.thawIfMarked(ctx, m)
	}
	return nil
}

// running says whether m's QEMU runs its guest (QMP query-status).
func (d *Driver) running(ctx context.Context, m *agent.Machine) bool {
	var st qmpStatus
	err := d.withMonitor(ctx, m, func(q *monitor) (err error) { st, err = q.queryStatus(ctx); return err })
	return err == nil && st.Running
}

// Observe checks that the VM's QEMU is alive and is that VM's (pid, start
// time, command line), then asks QMP for its run state.
func (d *Driver) Observe(ctx context.Context, m *agent.Machine, last string) agent.Observed {
	alive, why := checkProcess(m.Process, pidfileOf(m))
	var found agent.Process
	if !alive {
		// A QEMU that the metadata does not name (the agent died between
		// starting it and recording its pid) is still this VM's.
		if ps := findProcesses(pidfileOf(m)); len(ps) == 1 {
			found, alive = ps[0], true
			found.LaunchDir = m.Process.LaunchDir
			m.Process = found
		}
	}
	if !alive {
		switch last {
		case agentapi.StateStopped:
			return agent.Observed{State: agentapi.StateStopped}
		case agentapi.StateCreating:
			return agent.Observed{State: agentapi.StateStopped, Reason: "the agent stopped while it was creating this vm: " + why + "; start it again"}
		}
		return agent.Observed{State: agentapi.StateStopped,
			Reason: why + " (crashed, killed, or powered off from inside); start the vm to boot it again"}
	}
	// A QEMU the agent found again (after its restart) has its console
	// log trimmed again.
	d.watchConsole(m)
	var st qmpStatus
	if err := d.withMonitor(ctx, m, func(q *monitor) (err error) { st, err = q.queryStatus(ctx); return err }); err != nil {
		return agent.Observed{State: agentapi.StateError, Process: found,
			Reason: fmt.Sprintf("qemu process %d runs but its qmp socket does not answer: %v", m.Process.PID, err)}
	}
	obs := agent.Observed{Process: found}
	switch st.Status {
	case "running":
		obs.State = agentapi.StateRunning
	case "paused", "prelaunch", "suspended", "inmigrate", "postmigrate", "finish-migrate",
		"save-vm", "restore-vm", "debug", "colo":
		obs.State = agentapi.StatePaused
	default:
		// internal-error, io-error, guest-panicked, watchdog, shutdown
		// (with -no-shutdown): QEMU runs but the guest cannot go on.
		obs.State, obs.Reason = agentapi.StateError, "qemu run state "+st.Status+"; stop and start the vm"
	}
	return obs
}

// Console returns the end of the VM's serial console log: never while the
// trimmer rewrites it.
func (d *Driver) Console(m *agent.Machine, limit int64) ([]byte, error) {
	d.consoleMu.Lock()
	defer d.consoleMu.Unlock()
	f, err := os.Open(filepath.Join(m.Dir, consoleFileName))
	if errors.Is(err, os.ErrNotExist) {
		return []byte{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("console of vm %s: %w", m.ID, err)
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	off := max(0, fi.Size()-limit)
	return io.ReadAll(io.NewSectionReader(f, off, fi.Size()-off))
}

// markBoot appends the boot marker line (agent.ConsoleBootMarker) to the
// VM's console log before QEMU starts: what the guest printed before it
// belongs to an earlier boot. The earlier boots keep half the log's cap.
func (d *Driver) markBoot(m *agent.Machine) error {
	d.consoleMu.Lock()
	defer d.consoleMu.Unlock()
	path := filepath.Join(m.Dir, consoleFileName)
	if _, err := trimConsole(path, d.opts.ConsoleLogBytes/2); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("trim the console log: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		return fmt.Errorf("mark the boot in the console log: %w", err)
	}
	_, err = fmt.Fprintf(f, "\r\n%s%s at %s\r\n", agent.ConsoleBootMarker, m.ID, time.Now().UTC().Format(time.RFC3339))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("mark the boot in the console log: %w", err)
	}
	return nil
}
