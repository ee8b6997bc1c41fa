package qemu

// Snapshots of running guests and children started from them.
//
// A snapshot of a VM freezes its current disk file and saves its memory, in
// one window in which the vCPUs are stopped:
//
//  1. disk.<n+1>.qcow2 is made (qcow2.WriteOverlay), an overlay
//     whose backing file is the current disk.<n>.qcow2 (disk.qcow2 for
//     n = 0), named relative to it;
//  2. QMP stop;
//  3. QMP blockdev-snapshot-sync (mode existing) moves the guest's drive onto
//     the new overlay; QEMU reopens the old file read-only, and nothing
//     writes it again: it is the frozen disk;
//  4. the frozen disk and the files below it are hard-linked into the
//     snapshot directory (same names, so relative backing names resolve);
//  5. QMP migrate to memory.state (a descriptor handed to QEMU with getfd,
//     so no process runs in between) saves the device state; with
//     the migration capability x-ignore-shared, it leaves out the RAM,
//     which QEMU maps shared from a memfd (qemu.go); the MIGRATION event
//     (capability "events") tells when it is done;
//  6. the memfd, opened through /proc/<pid>/fd, is copied into memory.ram,
//     a sparse file of its non-zero pages (agent.CopySparse);
//  7. QMP cont, unless the source is to stay paused.
//
// A child's disk is an overlay named relative to the frozen disk, e.g.
// ../../snapshots/<id>/disk.qcow2: vms/<id> and snapshots/<id> sit at the
// same depth of every agent's state directory, so the name resolves on any
// agent that has the snapshot. The child's QEMU has the source's command
// line (same machine, memory, devices) with its own disk, its RAM mapped
// copy-on-write from memory.ram, -S and -incoming defer; QMP sets
// x-ignore-shared and migrate-incoming from memory.state (getfd) loads the
// device state, and once the MIGRATION event says it is loaded the child is
// continued. One QMP session serves a whole snapshot, and one a child's
// start (qmp.go). It never reads its RAM up
// front: pages come in from the page cache as the guest touches them, and
// the children of one host share the pages they only read.
//
// A child of a snapshot that is being pulled from another agent starts
// early (StartSpawn): once the frozen disk chain is here and checked, its
// overlay is made and its QEMU started with -incoming defer, opening the
// frozen disk in the pull directory (backing.file.filename overrides the
// name in the overlay's header, which names the snapshot's own directory)
// and mapping the RAM image there, created at its full size and still
// being written. QEMU writes no guest RAM while it waits for incoming
// state. migrate-incoming, the first read of the state and of the RAM,
// comes only once the pull has checked every file's sha256 and moved the
// directory into place (Finish); a pull that fails ends the child's QEMU.
//
// A VM whose RAM is not a memfd (a child: its RAM is that private mapping)
// is snapshotted with its RAM in memory.state, and its children load it
// from there into a memfd of their own.
//
// vmgenid,guid=auto gives a child a new generation id, which QEMU writes
// into the guest's memory after loading the state and signals with an ACPI
// notification. VMs have no NIC, so there is no MAC to change.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

const (
	memoryFileName = "memory.state"
	ramFileName    = "memory.ram"
	// migrateTimeout bounds saving a VM's memory to a file, and loading it.
	migrateTimeout = 5 * time.Minute
	// migrateBandwidth lifts QEMU's migration rate limit (32 MiB/s by
	// default): the target is a local file and the vCPUs are stopped, so
	// the fastest copy is the shortest pause.
	migrateBandwidth = 64 << 30
	// driveID is the -drive id of a VM's disk (args in qemu.go).
	driveID = "disk0"
	// migrationFD names the descriptor of the memory state file that a
	// snapshot or a child's start hands QEMU (getfd) for its migration.
	migrationFD = "migration"
)

var _ agent.Snapshotter = (*Driver)(nil)

// diskPath is the disk file m writes to.
func diskPath(m *agent.Machine) string {
	if m.Disk != "" {
		return filepath.Join(m.Dir, m.Disk)
	}
	return filepath.Join(m.Dir, diskFileName)
}

// diskFile is the name of generation g of a VM's disk chain.
func diskFile(g int) string {
	if g == 0 {
		return diskFileName
	}
	return "disk." + strconv.Itoa(g) + ".qcow2"
}

var (
	diskFilePattern = regexp.MustCompile(`^disk(?:\.([1-9][0-9]*))?\.qcow2$`)
	diskNodePattern = regexp.MustCompile(`^disk-g([1-9][0-9]*)$`)
)

// SnapshotPauses is how many times this driver stopped a VM for a
// snapshot: a retried snapshot must not stop its VM again.
func (d *Driver) SnapshotPauses() int64 { return d.snapshotPauses.Load() }

// activeDisk asks QEMU which generation of the disk chain the guest writes
// to: QEMU is the truth, also when the agent died before recording a switch.
func (d *Driver) activeDisk(ctx context.Context, q *monitor, m *agent.Machine) (int, int64, error) {
	blocks, err := q.queryBlock(ctx)
	if err != nil {
		return 0, 0, err
	}
	for _, b := range blocks {
		if b.Device != driveID || b.Inserted == nil {
			continue
		}
		// A node made by a snapshot carries its generation in its name; a
		// drive opened from the command line names its file.
		if sm := diskNodePattern.FindStringSubmatch(b.Inserted.NodeName); sm != nil {
			g, _ := strconv.Atoi(sm[1])
			return g, b.Inserted.Image.VirtualSize, nil
		}
		if sm := diskFilePattern.FindStringSubmatch(filepath.Base(blockFileName(b.Inserted.File))); sm != nil {
			g, _ := strconv.Atoi(sm[1]) // "" for disk.qcow2: 0
			return g, b.Inserted.Image.VirtualSize, nil
		}
		return 0, 0, fmt.Errorf("vm %s: drive %s is node %q on %q, not a disk chain file of this driver", m.ID, driveID, b.Inserted.NodeName, b.Inserted.File)
	}
	return 0, 0, fmt.Errorf("vm %s: qemu has no drive %s", m.ID, driveID)
}

// blockFileName is the file of a drive as query-block names it: QEMU
// names a drive opened with options for its backing file (a child started
// while its snapshot was pulled, StartSpawn) by a json: pseudo-filename,
// whose top-level file.filename is the drive's own file.
func blockFileName(name string) string {
	rest, ok := strings.CutPrefix(name, "json:")
	if !ok {
		return name
	}
	var v struct {
		File struct {
			Filename string `json:"filename"`
		} `json:"file"`
	}
	if err := json.Unmarshal([]byte(rest), &v); err != nil {
		return name
	}
	return v.File.Filename
}

// Snapshot implements agent.Snapshotter (see the file comment).
func (d *Driver) Snapshot(ctx context.Context, m *agent.Machine, dir string, opts agent.SnapshotOptions) (agent.SnapshotFiles, error) {
	files := agent.SnapshotFiles{Memory: memoryFileName}
	if alive, why := checkProcess(m.Process, pidfileOf(m)); !alive {
		return files, fmt.Errorf("snapshot vm %s: %s", m.ID, why)
	}
	q, err := d.monitor(ctx, m)
	if err != nil {
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}
	defer func() { _ = q.Close() }()
	st, err := q.queryStatus(ctx)
	if err != nil {
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}
	if st.Status == "postmigrate" {
		// QEMU refuses a second migration until the VM has run again.
		return files, agent.ErrSnapshotConflict("vm %s is still paused by an earlier snapshot that kept it paused; resume it before taking another snapshot", m.ID)
	}
	wasRunning := st.Running
	if err := q.migrateSetMaxBandwidth(ctx, migrateBandwidth); err != nil {
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}
	memfd, err := ramMemfd(m.Process.PID)
	if err != nil {
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}
	if err := q.migrateSetCapabilities(ctx, migrationCaps(memfd != "")...); err != nil {
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}

	gen, next := -1, ""
	var frozenChain []string
	if m.DiskMiB > 0 {
		g, size, err := d.activeDisk(ctx, q, m)
		if err != nil {
			return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
		}
		gen, next = g, diskFile(g+1)
		// The files the snapshot freezes: the one the guest writes and
		// those below it, fewer than its generations once flattened.
		if frozenChain, err = ownChain(m.Dir, diskFile(gen)); err != nil {
			return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
		}
		// Made before the pause, which it does not need.
		if err := qcow2.WriteOverlay(filepath.Join(m.Dir, next), diskFile(gen), size); err != nil {
			return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
		}
		// QEMU opens it after it dropped root: its uid's file.
		if d.runAs {
			uid, err := d.vmUID(m)
			if err == nil {
				err = chownWritable(filepath.Join(m.Dir, next), uid)
			}
			if err != nil {
				_ = os.Remove(filepath.Join(m.Dir, next))
				return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
			}
		}
		if err := opts.RecordDisk(next); err != nil {
			_ = os.Remove(filepath.Join(m.Dir, next))
			return files, fmt.Errorf("snapshot vm %s: record its new disk %s: %w", m.ID, next, err)
		}
	}

	// A guest with the guest agent channel syncs and freezes its file
	// systems before the pause, so that the frozen disk is consistent on
	// its own (qga_vm.go freeze: a guest agent that does not answer
	// leaves the snapshot unfrozen, with a warning). The memory state is
	// saved frozen too: a VM started from it is thawed (Finish).
	tfreeze := time.Now()
	frozen := m.GuestAgent && wasRunning && d.freeze(ctx, m)
	files.FSFrozen = frozen
	tf := time.Now()
	d.snapshotPauses.Add(1)
	t0 := time.Now()
	// From here the VM is stopped; every failure continues it if it ran,
	// and thaws it if it froze.
	fail := func(err error) (agent.SnapshotFiles, error) {
		if wasRunning {
			cctx := context.WithoutCancel(ctx)
			if cerr := d.rescue(cctx, m, q, func(q *monitor) error { return q.cont(cctx) }); cerr != nil {
				err = errors.Join(err, fmt.Errorf("continue the vm: %w", cerr))
			} else if frozen {
				if terr := d.thaw(cctx, m); terr != nil {
					err = errors.Join(err, terr)
				}
			}
		}
		return files, fmt.Errorf("snapshot vm %s: %w", m.ID, err)
	}
	// Before the switch the guest still writes to the old file: record it
	// again. (Were that to fail, the record names the empty overlay on the
	// file the guest writes, which reads the same.)
	unswitch := func(err error) (agent.SnapshotFiles, error) {
		if m.DiskMiB > 0 {
			if rerr := opts.RecordDisk(diskFile(gen)); rerr != nil {
				err = errors.Join(err, fmt.Errorf("record the disk back: %w", rerr))
			} else {
				_ = os.Remove(filepath.Join(m.Dir, next))
			}
		}
		return fail(err)
	}
	if err := q.stop(ctx); err != nil {
		return unswitch(err)
	}
	if m.DiskMiB > 0 {
		if err := q.blockdevSnapshotSync(ctx, driveID, filepath.Join(m.Dir, next), fmt.Sprintf("disk-g%d", gen+1)); err != nil {
			return unswitch(err)
		}
		m.Disk = next
		for i, name := range frozenChain {
			if err := os.Link(filepath.Join(m.Dir, name), filepath.Join(dir, name)); err != nil {
				return fail(fmt.Errorf("link frozen disk %s into the snapshot: %w", name, err))
			}
			// The frozen files are read-only from now on, for every link.
			if err := freezeDisk(filepath.Join(dir, name), d.runAs); err != nil {
				return fail(err)
			}
			if i == 0 {
				files.Disk = name
			} else {
				files.Backing = append(files.Backing, name)
			}
		}
	}
	// Its read-write volumes, frozen at the same point (volume_fork.go).
	for _, sw := range opts.Volumes {
		if err := switchVolume(ctx, q, sw); err != nil {
			return fail(err)
		}
		files.SwitchedVolumes = append(files.SwitchedVolumes, sw.Volume.ID)
	}
	if _, err := os.Stat(varsPath(m)); err == nil {
		// A uefi VM's variables as they are while it is stopped: each
		// child gets a copy (QEMU writes the flash through at once).
		if err := copyFile(varsPath(m), filepath.Join(dir, agent.VarsFileName)); err != nil {
			return fail(fmt.Errorf("copy the uefi variables into the snapshot: %w", err))
		}
		if err := os.Chmod(filepath.Join(dir, agent.VarsFileName), 0o444); err != nil {
			return fail(err)
		}
		files.Vars = agent.VarsFileName
	}
	t1 := time.Now()
	if err := d.saveMemory(ctx, q, m, filepath.Join(dir, memoryFileName)); err != nil {
		return fail(err)
	}
	t2 := time.Now()
	if memfd != "" {
		digest, err := copyRAM(filepath.Join(dir, ramFileName), memfd, m.MemoryMiB<<20)
		if err != nil {
			return fail(err)
		}
		files.RAM, files.RAMDigest = ramFileName, digest
	}
	t3 := time.Now()
	switch {
	case wasRunning && !opts.KeepPaused:
		if err := q.cont(ctx); err != nil {
			return files, fmt.Errorf("snapshot vm %s: saved, but continuing the vm failed: %w", m.ID, err)
		}
		if frozen {
			// The snapshot is whole either way: a thaw that fails every try
			// is logged as an error and counted (ThawFailures), and the
			// fork goes on; its children are thawed on their own.
			_ = d.thaw(context.WithoutCancel(ctx), m)
		}
	case frozen:
		// Paused, it cannot answer: its resume thaws it.
		if err := markFrozen(m); err != nil {
			return files, fmt.Errorf("snapshot vm %s: saved, kept paused with frozen file systems, but recording that failed: %w", m.ID, err)
		}
	}
	d.log.Info("vm snapshotted", "vm", m.ID, "ram_mapped", memfd != "", "fs_frozen", frozen, "freeze_ms", tf.Sub(tfreeze).Milliseconds(),
		"switch_ms", t1.Sub(t0).Milliseconds(),
		"state_ms", t2.Sub(t1).Milliseconds(), "ram_ms", t3.Sub(t2).Milliseconds(), "cont_ms", time.Since(t3).Milliseconds())
	return files, nil
}

// saveMemory migrates the stopped VM into the file path and waits for the
// MIGRATION event that ends it. QEMU writes the file itself, through a
// descriptor handed over the QMP socket (no process in between).
func (d *Driver) saveMemory(ctx context.Context, q *monitor, m *agent.Machine, path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if err != nil {
		return fmt.Errorf("save memory: %w", err)
	}
	err = q.getfd(ctx, migrationFD, f)
	_ = f.Close() // QEMU has its own copy
	if err == nil {
		err = q.migrate(ctx, "fd:"+migrationFD)
	}
	if err != nil {
		return err
	}
	status, err := q.waitMigration(ctx, migrateTimeout)
	if err != nil {
		cctx := context.WithoutCancel(ctx)
		if cerr := d.rescue(cctx, m, q, func(q *monitor) error { return q.migrateCancel(cctx) }); cerr != nil {
			err = errors.Join(err, fmt.Errorf("cancel the migration: %w", cerr))
		}
		return fmt.Errorf("save memory to %s (cancelled): %w", path, err)
	}
	if status != "completed" {
		info, err := q.queryMigrate(ctx)
		if err != nil {
			return fmt.Errorf("save memory to %s: migration %s (%w)", path, status, err)
		}
		return fmt.Errorf("save memory to %s: migration %s: %s", path, status, info.ErrorDesc)
	}
	return waitPostmigrate(ctx, q)
}

// postmigratePoll is how often waitPostmigrate asks for the run state.
const postmigratePoll = time.Millisecond

// waitPostmigrate waits until QEMU has marked the VM postmigrate after a
// completed migration. QEMU's migration thread announces the end (the
// MIGRATION event) before it takes the main lock to set that run state: a
// cont in between runs the guest, which is then marked postmigrate all
// the same, and the next snapshot is refused as if the VM were paused.
// QEMU sends no event for the run state, so this asks, in the same
// session; usually the first answer is postmigrate already.
func waitPostmigrate(ctx context.Context, q *monitor) error {
	deadline := time.Now().Add(qmpTimeout)
	for {
		st, err := q.queryStatus(ctx)
		switch {
		case err != nil:
			return err
		case st.Status != "finish-migrate":
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("qemu run state still %s %s after the migration completed", st.Status, qmpTimeout)
		}
		time.Sleep(postmigratePoll)
	}
}

// migrationCaps are the migration capabilities of a snapshot or a child's
// start: events, so that the MIGRATION event tells when the state is saved
// or loaded, and x-ignore-shared on when the RAM is a file of its own (a
// migration then leaves out RAM that QEMU maps shared).
func migrationCaps(ignoreShared bool) []migrationCapability {
	return []migrationCapability{{Capability: "events", State: true}, {Capability: "x-ignore-shared", State: ignoreShared}}
}

// memfdLink is how /proc/<pid>/fd shows the memfd of a VM's RAM object.
const memfdLink = "/memfd:memory-backend-memfd"

// ramMemfd is the /proc path of the memfd that holds QEMU pid's guest RAM,
// or "" when its RAM is not a memfd.
func ramMemfd(pid int) (string, error) {
	fdDir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(fdDir)
	if err != nil {
		return "", fmt.Errorf("list the files of qemu %d: %w", pid, err)
	}
	var found []string
	for _, e := range ents {
		if link, err := os.Readlink(filepath.Join(fdDir, e.Name())); err == nil && strings.HasPrefix(link, memfdLink) {
			found = append(found, filepath.Join(fdDir, e.Name()))
		}
	}
	if len(found) > 1 {
		return "", fmt.Errorf("qemu %d has %d memfd memory backends, want one for its RAM", pid, len(found))
	}
	if len(found) == 0 {
		return "", nil
	}
	return found[0], nil
}

// copyRAM copies the guest RAM in memfd (size bytes) into a new read-only
// sparse file at path and returns its digest (agent.SparseDigest).
func copyRAM(path, memfd string, size int64) (string, error) {
	src, err := os.Open(memfd)
	if err != nil {
		return "", fmt.Errorf("open the vm's ram: %w", err)
	}
	defer func() { _ = src.Close() }()
	dst, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o444)
	if err != nil {
		return "", fmt.Errorf("save ram: %w", err)
	}
	digest, err := agent.CopySparse(dst, src, size)
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Errorf("save ram: %w", err)
	}
	return digest, nil
}

// Spawn implements agent.Snapshotter (see the file comment).
func (d *Driver) Spawn(ctx context.Context, m *agent.Machine, dir string, files agent.SnapshotFiles) error {
	p, err := d.startSpawn(ctx, m, dir, dir, files)
	if err != nil {
		return err
	}
	return p.Finish(ctx)
}

var _ agent.EarlySpawner = (*Driver)(nil)

// StartSpawn implements agent.EarlySpawner: the child's overlay names the
// frozen disk in dir, where the snapshot will be, while QEMU opens it and
// maps the RAM image in at, where the files are now. QEMU reads neither
// the RAM image nor the device state before Finish.
func (d *Driver) StartSpawn(ctx context.Context, m *agent.Machine, dir, at string, files agent.SnapshotFiles) (agent.PendingSpawn, error) {
	d.earlyStarts.Add(1)
	p, err := d.startSpawn(ctx, m, dir, at, files)
	if err != nil {
		return nil, err // not a nil *pendingSpawn in an interface
	}
	return p, nil
}

// EarlyStarts is how many children StartSpawn began to start while their
// snapshot was still being pulled.
func (d *Driver) EarlyStarts() int64 { return d.earlyStarts.Load() }

// pendingSpawn is a child's QEMU started with -incoming defer, waiting
// for its state.
type pendingSpawn struct {
	d     *Driver
	m     *agent.Machine
	q     *monitor
	state string // the device state file in the snapshot's own directory
	ram   bool
	// frozen: the saved guest's file systems are frozen (a snapshot of a
	// VM with the guest agent channel): Finish thaws them.
	frozen  bool
	t0, t1  time.Time
	started time.Time
}

func (d *Driver) startSpawn(ctx context.Context, m *agent.Machine, dir, at string, files agent.SnapshotFiles) (*pendingSpawn, error) {
	t0 := time.Now()
	m.Disk = ""
	var child childFiles
	if m.DiskMiB > 0 {
		if files.Disk == "" {
			return nil, fmt.Errorf("start vm %s: the snapshot has no disk, the vm has %d MiB", m.ID, m.DiskMiB)
		}
		backing, err := filepath.Rel(m.Dir, filepath.Join(dir, files.Disk))
		if err != nil {
			return nil, fmt.Errorf("start vm %s: %w", m.ID, err)
		}
		// The frozen disk need not be there yet (StartSpawn).
		if err := qcow2.WriteOverlay(diskPath(m), backing, m.DiskMiB<<20); err != nil {
			return nil, fmt.Errorf("start vm %s: %w", m.ID, err)
		}
		if at != dir {
			child.backing = filepath.Join(at, files.Disk)
		}
	}
	if files.Vars != "" {
		// The child's own copy of its source's UEFI variables.
		if err := ensureVars(m, filepath.Join(at, files.Vars)); err != nil {
			return nil, fmt.Errorf("start vm %s: %w", m.ID, err)
		}
	}
	t1 := time.Now()
	state := filepath.Join(dir, files.Memory)
	if files.RAM != "" {
		child.ram = filepath.Join(at, files.RAM)
	}
	q, err := d.boot(ctx, m, agent.BootOptions{Incoming: state}, child)
	if err != nil {
		return nil, err
	}
	if err := q.migrateSetCapabilities(ctx, migrationCaps(child.ram != "")...); err != nil {
		_ = q.Close()
		d.killLeftovers(m)
		return nil, fmt.Errorf("start vm %s: set the migration capabilities: %w", m.ID, err)
	}
	return &pendingSpawn{d: d, m: m, q: q, state: state, ram: child.ram != "", frozen: files.FSFrozen && m.GuestAgent,
		t0: t0, t1: t1, started: time.Now()}, nil
}

// Abort implements agent.PendingSpawn.
func (p *pendingSpawn) Abort() {
	_ = p.q.Close()
	p.d.killLeftovers(p.m)
}

// Finish implements agent.PendingSpawn: it loads the device state (and
// with it the guest's view of its RAM) and continues the child.
func (p *pendingSpawn) Finish(ctx context.Context) error {
	d, m, q := p.d, p.m, p.q
	defer func() { _ = q.Close() }()
	t2 := time.Now()
	// QEMU reads the state through a descriptor handed over the QMP socket.
	f, err := os.Open(p.state)
	if err == nil {
		err = q.getfd(ctx, migrationFD, f)
		_ = f.Close() // QEMU has its own copy
	}
	if err == nil {
		err = q.migrateIncoming(ctx, "fd:"+migrationFD)
	}
	if err != nil {
		d.killLeftovers(m)
		return fmt.Errorf("start vm %s: load the snapshot's device state: %w", m.ID, err)
	}
	if err := d.waitIncoming(ctx, q, m); err != nil {
		d.killLeftovers(m)
		return err
	}
	t3 := time.Now()
	if err := q.cont(ctx); err != nil {
		d.killLeftovers(m)
		return fmt.Errorf("start vm %s: continue after loading the snapshot: %w", m.ID, err)
	}
	t4 := time.Now()
	if p.frozen {
		// The guest continues where its source froze: its writers wait
		// until this thaw. A failure is logged (thaw) and the child runs
		// on: the guest's own fsfreeze -u, or a restart, ends it.
		_ = d.thaw(context.WithoutCancel(ctx), m)
	}
	d.log.Info("vm continued from snapshot", "vm", m.ID, "ram_mapped", p.ram, "thaw_ms", time.Since(t4).Milliseconds(), "overlay_ms", p.t1.Sub(p.t0).Milliseconds(),
		"qemu_start_ms", p.started.Sub(p.t1).Milliseconds(), "files_wait_ms", t2.Sub(p.started).Milliseconds(),
		"load_wait_ms", t3.Sub(t2).Milliseconds(), "cont_ms", time.Since(t3).Milliseconds())
	return nil
}

// waitIncoming waits for the MIGRATION event that says QEMU loaded the
// memory state (QEMU exits if the state does not load), then checks that
// the VM is paused, ready to continue.
func (d *Driver) waitIncoming(ctx context.Context, q *monitor, m *agent.Machine) error {
	status, err := q.waitMigration(ctx, migrateTimeout)
	if err != nil {
		if waitGone(m.Process, pidfileOf(m), time.Second) {
			_, why := checkProcess(m.Process, pidfileOf(m))
			return fmt.Errorf("start vm %s: loading the snapshot failed: %s; see %s", m.ID, why, filepath.Join(m.Dir, consoleFileName))
		}
		return fmt.Errorf("start vm %s: the snapshot did not load: %w", m.ID, err)
	}
	if status != "completed" {
		return fmt.Errorf("start vm %s: loading the snapshot ended %s", m.ID, status)
	}
	st, err := q.queryStatus(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("start vm %s: %w", m.ID, err)
	case st.Status != "paused":
		return fmt.Errorf("start vm %s: qemu run state %s after loading the snapshot, want paused", m.ID, st.Status)
	}
	return nil
}
