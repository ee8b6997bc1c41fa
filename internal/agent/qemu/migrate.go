package qemu

// Live migration with QEMU (agent.Migrator).
//
// Memory: pre-copy while the guest runs, then stop-and-copy, over QEMU's
// migration stream. The source's QEMU writes it to one end of a socket
// pair handed over QMP (getfd, "fd:" URI); the agent bridges the other end
// to the authenticated channel to the target agent, which bridges it to the
// other end of a socket pair whose first end its QEMU (started with
// -incoming defer) reads the stream from. Nothing listens on TCP for QEMU.
//
// Convergence: auto-converge, not post-copy. Post-copy runs the guest on
// the target before all its memory arrived: a broken channel or an agent
// killed then leaves no complete copy anywhere, and the source could never
// run the VM again. With auto-converge the source keeps a complete, runnable
// copy until the switch, so a migration that does not converge within its
// bound is cancelled (migrate_cancel) and the VM simply goes on running on
// the source. QEMU throttles the vCPUs of a guest that dirties memory
// faster than the link drains it until the remaining memory fits in the
// downtime limit (300 ms, QEMU's default, unless the control plane says).
//
// Disk: the running overlay moves with NBD + blockdev-mirror, as libvirt
// does, not with QEMU's block migration (migrate -b / the "block"
// capability): that one is deprecated in QEMU 8.x and removed later, and it
// copies the disk inside the memory stream, so its size inflates the
// pre-copy. The target's QEMU exports its prepared, empty overlay (same
// size, same read-only base from the image on that agent) with
// nbd-server-start + block-export-add on a unix socket in the VM's
// directory; the source mirrors its overlay there (sync=top: only the
// overlay's own data, the base is the image both have) over a "disk"
// channel, waits for the mirror to be ready (in sync, every guest write
// mirrored), then migrates memory with pause-before-switchover: once the
// guest is paused for the switch, the mirror is cancelled (a ready mirror
// ends in sync without pivoting, the source keeps its own overlay intact)
// and only then the device state goes. A migration that fails at any point
// leaves the source's overlay the VM's disk.
//
// Volumes: each read-write volume moves the same way, in the same
// migration: the target's QEMU (started with the control plane's empty
// copy of each volume) exports it beside the overlay on the same NBD
// server, the source mirrors it there with sync=full (a volume has no base
// both agents share: its frozen bases are flattened into the copy), and
// all mirrors must be ready before memory goes and end together at the
// switch.
//
// Exactly one copy: the source's QEMU uses the return path, so it reports
// "completed" only once the target's QEMU loaded the whole stream; the
// target's QEMU is started with -S and stays paused until the target agent
// is committed (agent package).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	// nbdSocket is where a target's QEMU serves its overlay, in the VM's
	// directory; nbdListenFD the name QEMU knows its listener by.
	nbdSocket   = "nbd.sock"
	nbdListenFD = "nbdlisten"
	// mirrorJob and mirrorNode are the source's mirror job and the NBD
	// node it writes to; nbdExport the export name on the target.
	mirrorJob  = "mig-disk0"
	mirrorNode = "mig-nbd0"
	nbdExport  = "disk0"
	// migrationPoll is how often the source asks QEMU how far it is.
	migrationPoll = 10 * time.Millisecond
	// migrationBandwidth lifts QEMU's 32 MiB/s default rate limit: the
	// channel between agents is the limit.
	migrationBandwidth = 8 << 30
	migrationStreamFD  = "migstream"
	// incomingMigration is the BootOptions.Incoming of a live
	// migration's target (its state comes over the memory channel).
	incomingMigration = "migration"
)

var _ agent.Migrator = (*Driver)(nil)

// MigrationFiles: a cold migration moves the disk overlay; a live one
// mirrors it instead.
func (d *Driver) MigrationFiles(m *agent.Machine, live bool) ([]string, error) {
	if live || m.DiskMiB == 0 {
		return nil, nil
	}
	if m.Disk != "" {
		return nil, fmt.Errorf("vm %s writes to %s, a disk on a snapshot; it cannot migrate", m.ID, m.Disk)
	}
	if _, err := os.Stat(filepath.Join(m.Dir, diskFileName)); err != nil {
		return nil, fmt.Errorf("disk of vm %s: %w", m.ID, err)
	}
	return []string{diskFileName}, nil
}

// AdoptIncomingFiles checks the disk a cold migration brought: a qcow2
// with no backing file, or one on the base disk of the VM's image, whose
// name is then rewritten to this agent's copy of that disk.
func (d *Driver) AdoptIncomingFiles(ctx context.Context, m *agent.Machine, files []string) error {
	for _, f := range files {
		if f != diskFileName {
			continue
		}
		path := filepath.Join(m.Dir, f)
		info, err := d.imageInfo(ctx, path)
		if err != nil {
			return err
		}
		if info.Format != "qcow2" {
			return fmt.Errorf("disk of vm %s is %s, not qcow2", m.ID, info.Format)
		}
		if info.Backing == "" {
			continue
		}
		img, err := d.loadImage(m.Image)
		if err != nil {
			return err
		}
		if img.Disk == "" {
			return fmt.Errorf("disk of vm %s names a backing file %q but its image %s has no disk", m.ID, info.Backing, m.Image)
		}
		if err := d.rebaseHeader(ctx, path, d.path(img, img.Disk), img.EffectiveDiskFormat()); err != nil {
			return err
		}
	}
	return nil
}

type imgInfo struct {
	Format  string `json:"format"`
	Backing string `json:"backing-filename"`
}

func (d *Driver) imageInfo(ctx context.Context, path string) (imgInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, d.qemuImg, "info", "--output=json", "-U", path).Output()
	if err != nil {
		return imgInfo{}, fmt.Errorf("qemu-img info %s: %w", filepath.Base(path), err)
	}
	var info imgInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return imgInfo{}, fmt.Errorf("qemu-img info %s: %w", filepath.Base(path), err)
	}
	return info, nil
}

// PrepareIncoming starts m's QEMU paused, waiting for the stream on
// migrate.sock, with its overlay exported over NBD on nbd.sock.
func (d *Driver) PrepareIncoming(ctx context.Context, m *agent.Machine) error {
	for i := range m.NICs {
		for j := range m.NICs[i].PortForwards {
			m.NICs[i].PortForwards[j].HostPort = 0 // the source's ports are the source host's
		}
	}
	_ = os.Remove(filepath.Join(m.Dir, nbdSocket))
	q, err := d.boot(ctx, m, agent.BootOptions{Incoming: incomingMigration}, childFiles{})
	if err != nil {
		return err
	}
	defer func() { _ = q.Close() }()
	fail := func(err error) error {
		d.killLeftovers(m)
		return fmt.Errorf("prepare incoming vm %s: %w", m.ID, err)
	}
	if err := q.migrateSetCapabilities(ctx, migrationCapability{Capability: "events", State: true}); err != nil {
		return fail(err)
	}
	if exports := incomingExports(m); len(exports) > 0 {
		// QEMU runs as its VM's uid and cannot make a socket in the VM's
		// directory: the agent makes it (root's, 0600) and hands it over.
		l, err := listenUnixIn(m.Dir, nbdSocket)
		if err != nil {
			return fail(err)
		}
		lf, err := l.File()
		_ = l.Close()
		if err == nil {
			err = q.getfd(ctx, nbdListenFD, lf)
			_ = lf.Close()
		}
		if err != nil {
			return fail(err)
		}
		if err := q.run(ctx, "nbd-server-start", map[string]any{
			"addr": map[string]any{"type": "fd", "data": map[string]any{"str": nbdListenFD}},
		}, nil); err != nil {
			return fail(err)
		}
		for _, x := range exports {
			node, err := x.node(ctx, q)
			if err != nil {
				return fail(err)
			}
			if err := q.run(ctx, "block-export-add", map[string]any{
				"type": "nbd", "id": x.job, "node-name": node, "name": x.export, "writable": true,
			}, nil); err != nil {
				return fail(err)
			}
		}
	}
	// The stream comes through one end of a socket pair; the agent keeps
	// the other for the memory channel (lost with the agent: QEMU then
	// fails the incoming migration and exits).
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	qf, af := os.NewFile(uintptr(fds[0]), "incoming-qemu"), os.NewFile(uintptr(fds[1]), "incoming-agent")
	err = q.getfd(ctx, migrationStreamFD, qf)
	_ = qf.Close()
	if err == nil {
		err = q.migrateIncoming(ctx, "fd:"+migrationStreamFD)
	}
	if err != nil {
		_ = af.Close()
		return fail(err)
	}
	d.incomingMu.Lock()
	if d.incoming == nil {
		d.incoming = map[string]*os.File{}
	}
	if old := d.incoming[m.ID]; old != nil {
		_ = old.Close()
	}
	d.incoming[m.ID] = af
	d.incomingMu.Unlock()
	d.log.Info("vm waits for its incoming migration", "vm", m.ID, "pid", m.Process.PID, "disk", m.DiskMiB > 0, "volumes", len(m.Volumes))
	return nil
}

// dropIncoming closes the agent's end of VM id's incoming stream, if any.
func (d *Driver) dropIncoming(id string) {
	d.incomingMu.Lock()
	defer d.incomingMu.Unlock()
	if f := d.incoming[id]; f != nil {
		_ = f.Close()
		delete(d.incoming, id)
	}
}

// listenUnixIn listens on a unix socket name in dir (which may be longer
// than a socket address holds), mode 0600; closing the listener leaves
// the file.
func listenUnixIn(dir, name string) (*net.UnixListener, error) {
	df, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer func() { _ = df.Close() }()
	path := fmt.Sprintf("/proc/self/fd/%d/%s", df.Fd(), name)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(filepath.Join(dir, name), 0o600); err != nil {
		_ = l.Close()
		return nil, err
	}
	return l, nil
}

// diskNode is the node name of the VM's disk drive.
func diskNode(ctx context.Context, q *monitor) (string, error) {
	blocks, err := q.queryBlock(ctx)
	if err != nil {
		return "", err
	}
	for _, b := range blocks {
		if b.Device == driveID && b.Inserted != nil && b.Inserted.NodeName != "" {
			return b.Inserted.NodeName, nil
		}
	}
	return "", fmt.Errorf("qemu has no drive %s", driveID)
}

// Receive bridges one channel to the target QEMU's socket for it.
func (d *Driver) Receive(ctx context.Context, m *agent.Machine, channel string, conn net.Conn) error {
	switch channel {
	case agentapi.ChannelMemory:
		d.incomingMu.Lock()
		f := d.incoming[m.ID]
		delete(d.incoming, m.ID)
		d.incomingMu.Unlock()
		if f == nil {
			return fmt.Errorf("vm %s: its qemu's end of the stream is gone (the agent restarted, or a stream came already)", m.ID)
		}
		qc, err := net.FileConn(f)
		_ = f.Close()
		if err != nil {
			return err
		}
		return bridge(conn, qc)
	case agentapi.ChannelDisk:
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		qc, err := dialUnix(dctx, filepath.Join(m.Dir, nbdSocket))
		if err != nil {
			return fmt.Errorf("vm %s: connect to its qemu's nbd socket: %w", m.ID, err)
		}
		return bridge(conn, qc)
	}
	return fmt.Errorf("vm %s: no %s channel", m.ID, channel)
}

// bridge copies both ways between a and b until both directions ended,
// half-closing each side as its input ends; then it closes both.
func bridge(a, b net.Conn) error {
	var wg sync.WaitGroup
	errs := make([]error, 2)
	cp := func(i int, dst, src net.Conn) {
		defer wg.Done()
		_, errs[i] = io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			_ = dst.Close()
		}
	}
	wg.Add(2)
	go cp(0, a, b)
	go cp(1, b, a)
	wg.Wait()
	_ = a.Close()
	_ = b.Close()
	return errors.Join(errs...)
}

// IncomingState asks the target's QEMU where the incoming stream is. Once
// it completed, the NBD export ends (the source's mirror ended before).
func (d *Driver) IncomingState(ctx context.Context, m *agent.Machine) (string, string) {
	if alive, why := checkProcess(m.Process, pidfileOf(m)); !alive {
		return agent.IncomingFailed, "its qemu is gone: " + why
	}
	var info qmpMigration
	var st qmpStatus
	err := d.withMonitor(ctx, m, func(q *monitor) (err error) {
		if info, err = q.queryMigrate(ctx); err != nil {
			return err
		}
		st, err = q.queryStatus(ctx)
		if exports := incomingExports(m); err == nil && info.Status == "completed" && len(exports) > 0 {
			// They may have ended before (an earlier call): errors ignored.
			for _, x := range exports {
				_ = q.run(ctx, "block-export-del", map[string]any{"id": x.job}, nil)
			}
			_ = q.run(ctx, "nbd-server-stop", nil, nil)
		}
		return err
	})
	switch {
	case err != nil:
		return agent.IncomingActive, "its qmp socket does not answer: " + err.Error()
	case info.Status == "completed" && st.Status == "paused":
		return agent.IncomingCompleted, ""
	case info.Status == "failed" || info.Status == "cancelled":
		return agent.IncomingFailed, "qemu: migration " + info.Status + " " + info.ErrorDesc
	case st.Status == "running":
		// Never resumed by this agent before a commit: treat as failed.
		return agent.IncomingFailed, "its qemu runs the guest without a commit"
	}
	return agent.IncomingActive, info.Status
}

// qmpMigrationStats is query-migrate's answer with the figures.
type qmpMigrationStats struct {
	Status           string `json:"status"`
	ErrorDesc        string `json:"error-desc"`
	TotalTime        int64  `json:"total-time"`
	Downtime         int64  `json:"downtime"`
	ExpectedDowntime int64  `json:"expected-downtime"`
	SetupTime        int64  `json:"setup-time"`
	Throttle         int64  `json:"cpu-throttle-percentage"`
	RAM              *struct {
		Transferred int64 `json:"transferred"`
		Remaining   int64 `json:"remaining"`
		Total       int64 `json:"total"`
		// Duplicate counts the zero pages sent (a flag each), Normal the
		// pages sent whole; DirtySyncCount the passes over the bitmap.
		Duplicate      int64   `json:"duplicate"`
		Normal         int64   `json:"normal"`
		DirtySyncCount int64   `json:"dirty-sync-count"`
		MBps           float64 `json:"mbps"`
	} `json:"ram"`
}

func (s qmpMigrationStats) wire(phase string) agentapi.Migration {
	w := agentapi.Migration{Phase: phase, TotalMS: s.TotalTime, DowntimeMS: s.Downtime, ExpectedDowntimeMS: s.ExpectedDowntime,
		SetupMS: s.SetupTime, Throttle: s.Throttle}
	if s.RAM != nil {
		w.Memory = agentapi.MigrationBytes{Total: s.RAM.Total, Transferred: s.RAM.Transferred, Remaining: s.RAM.Remaining}
	}
	return w
}

type qmpBlockJob struct {
	Device string `json:"device"`
	Len    int64  `json:"len"`
	Offset int64  `json:"offset"`
	Ready  bool   `json:"ready"`
	Status string `json:"status"`
}

func (q *monitor) blockJob(ctx context.Context, id string) (*qmpBlockJob, error) {
	var jobs []qmpBlockJob
	if err := q.run(ctx, "query-block-jobs", nil, &jobs); err != nil {
		return nil, err
	}
	for i := range jobs {
		if jobs[i].Device == id {
			return &jobs[i], nil
		}
	}
	return nil, nil
}

// MigrateOut moves running m to the target (see the top of this file).
func (d *Driver) MigrateOut(ctx context.Context, m *agent.Machine, out agent.MigrateOut) (agentapi.Migration, error) {
	var stats agentapi.Migration
	progress := func(p agentapi.Migration) {
		stats = p
		if out.Progress != nil {
			out.Progress(p)
		}
	}
	q, err := d.monitor(ctx, m)
	if err != nil {
		return stats, err
	}
	defer func() { _ = q.Close() }() // the last session
	// The clean-ups run to the end even when ctx ended (a cancel).
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer ccancel()
	converge, cancelConverge := context.WithTimeout(ctx, max(out.Converge, time.Second))
	defer cancelConverge()

	var bridges sync.WaitGroup
	defer bridges.Wait()
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			_ = c.Close()
		}
	}()
	mirrors := incomingExports(m) // the source's mirrors of the target's exports
	// The disk channel's connections end with the migration, whatever
	// became of the mirror: left to QEMU (an NBD node that a failure after
	// the switch left attached) and the target (whose NBD server waits for
	// the commit), their bridges never ended and the migration hung in
	// bridges.Wait with the guest paused on both sides.
	var diskMu sync.Mutex
	var diskConns []net.Conn
	diskEnded := false
	keepDiskConn := func(c net.Conn) bool {
		diskMu.Lock()
		defer diskMu.Unlock()
		if diskEnded {
			return false
		}
		diskConns = append(diskConns, c)
		return true
	}
	defer func() {
		diskMu.Lock()
		defer diskMu.Unlock()
		diskEnded = true
		for _, c := range diskConns {
			_ = c.Close()
		}
	}()
	mirroring := false
	endMirror := func() {
		if !mirroring {
			return
		}
		mirroring = false
		_ = d.rescue(cctx, m, q, func(q *monitor) error {
			for _, x := range mirrors {
				_ = q.run(cctx, "block-job-cancel", map[string]any{"device": x.job, "force": true}, nil)
			}
			for _, x := range mirrors {
				for range 500 {
					if j, err := q.blockJob(cctx, x.job); err != nil || j == nil {
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			var errs []error
			for _, x := range mirrors {
				errs = append(errs, q.run(cctx, "blockdev-del", map[string]any{"node-name": x.nbdNode}, nil))
			}
			return errors.Join(errs...)
		})
	}
	defer endMirror()

	if len(mirrors) > 0 {
		// What an earlier migration cut short (its agent killed) may have
		// left: its mirror jobs and NBD nodes.
		for _, x := range mirrors {
			_ = q.run(ctx, "block-job-cancel", map[string]any{"device": x.job, "force": true}, nil)
			_ = q.run(ctx, "blockdev-del", map[string]any{"node-name": x.nbdNode}, nil)
		}
		progress(agentapi.Migration{Phase: agentapi.PhaseDisk})
		l, name, err := listenAbstract(m.ID)
		if err != nil {
			return stats, err
		}
		closers = append(closers, l)
		pid := m.Process.PID
		bridges.Add(1)
		go func() {
			defer bridges.Done()
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				if !fromPID(c, pid) {
					d.log.Warn("nbd connection refused: not from the vm's qemu", "vm", m.ID)
					_ = c.Close()
					continue
				}
				ch, err := out.Dial(ctx, agentapi.ChannelDisk)
				if err != nil {
					d.log.Warn("open the disk channel", "vm", m.ID, "err", err)
					_ = c.Close()
					continue
				}
				if !keepDiskConn(c) || !keepDiskConn(ch) {
					_ = c.Close()
					_ = ch.Close()
					continue
				}
				bridges.Add(1)
				go func() { defer bridges.Done(); _ = bridge(c, ch) }()
			}
		}()
		for _, x := range mirrors {
			node, err := x.node(ctx, q)
			if err != nil {
				return stats, err
			}
			if err := q.run(ctx, "blockdev-add", map[string]any{
				"driver": "nbd", "node-name": x.nbdNode, "export": x.export,
				"server": map[string]any{"type": "unix", "path": name, "abstract": true},
			}, nil); err != nil {
				return stats, fmt.Errorf("connect the mirror of %s of vm %s to its target: %w", x.what, m.ID, err)
			}
			mirroring = true
			if err := q.run(ctx, "blockdev-mirror", map[string]any{
				"job-id": x.job, "device": node, "target": x.nbdNode, "sync": x.sync,
			}, nil); err != nil {
				return stats, fmt.Errorf("mirror %s of vm %s: %w", x.what, m.ID, err)
			}
		}
		for {
			ready := true
			stats.Disk = agentapi.MigrationBytes{}
			for _, x := range mirrors {
				j, err := q.blockJob(converge, x.job)
				if err != nil {
					return stats, fmt.Errorf("mirror of %s of vm %s: %w", x.what, m.ID, err)
				}
				if j == nil {
					return stats, fmt.Errorf("mirror of %s of vm %s ended before it was in sync", x.what, m.ID)
				}
				stats.Disk.Total += j.Len
				stats.Disk.Transferred += j.Offset
				stats.Disk.Remaining += j.Len - j.Offset
				ready = ready && j.Ready
			}
			progress(stats)
			if ready {
				break
			}
			select {
			case <-converge.Done():
				return stats, fmt.Errorf("mirror of vm %s not in sync within %s: %w", m.ID, out.Converge, converge.Err())
			case <-time.After(50 * time.Millisecond):
			}
		}
	}

	caps := []migrationCapability{
		{Capability: "events", State: true}, {Capability: "x-ignore-shared", State: false},
		{Capability: "auto-converge", State: true}, {Capability: "return-path", State: true},
		{Capability: "pause-before-switchover", State: len(mirrors) > 0},
	}
	if err := q.migrateSetCapabilities(ctx, caps...); err != nil {
		return stats, err
	}
	downtime := out.MaxDowntime
	if downtime <= 0 {
		downtime = 300 * time.Millisecond
	}
	if err := q.run(ctx, "migrate-set-parameters", map[string]any{
		"downtime-limit": downtime.Milliseconds(), "max-bandwidth": migrationBandwidth,
	}, nil); err != nil {
		return stats, err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return stats, err
	}
	qf := os.NewFile(uintptr(fds[0]), "migration-qemu")
	af := os.NewFile(uintptr(fds[1]), "migration-agent")
	ac, err := net.FileConn(af)
	_ = af.Close()
	if err != nil {
		_ = qf.Close()
		return stats, err
	}
	closers = append(closers, ac)
	ch, err := out.Dial(ctx, agentapi.ChannelMemory)
	if err != nil {
		_ = qf.Close()
		return stats, err
	}
	closers = append(closers, ch)
	bridges.Add(1)
	go func() { defer bridges.Done(); _ = bridge(ac, ch) }()
	err = q.getfd(ctx, migrationStreamFD, qf)
	_ = qf.Close() // QEMU has its own copy
	if err == nil {
		err = q.migrate(ctx, "fd:"+migrationStreamFD)
	}
	if err != nil {
		return stats, fmt.Errorf("start the migration of vm %s: %w", m.ID, err)
	}
	progress(agentapi.Migration{Phase: agentapi.PhaseMemory, Disk: stats.Disk})
	var preSwitch, mirrorEnded time.Time
	// lastActive is QEMU's last answer before the guest stopped: what
	// the stop-and-copy had left to send.
	var lastActive qmpMigrationStats
	cancelled := false
	cancel := func() {
		if cancelled {
			return
		}
		cancelled = true
		_ = d.rescue(cctx, m, q, func(q *monitor) error { return q.migrateCancel(cctx) })
	}
	for {
		var s qmpMigrationStats
		qctx := ctx
		if cancelled || ctx.Err() != nil {
			qctx = cctx
		}
		if q.broken != nil {
			// A deadline or the cancel cut the session short: a new one.
			_ = q.Close()
			if q, err = d.monitor(cctx, m); err != nil {
				return stats, fmt.Errorf("migration of vm %s: qemu does not answer: %w", m.ID, err)
			}
		}
		if err := q.run(qctx, "query-migrate", nil, &s); err != nil {
			if cancelled {
				return stats, fmt.Errorf("migration of vm %s cancelled; qemu does not answer: %w", m.ID, err)
			}
			cancel()
			continue
		}
		if s.Status == "active" && s.RAM != nil {
			lastActive = s
		}
		phase := agentapi.PhaseMemory
		switch s.Status {
		case "pre-switchover", "device":
			phase = agentapi.PhaseStopAndCopy
		}
		p := s.wire(phase)
		p.Disk = stats.Disk
		progress(p)
		switch s.Status {
		case "completed":
			if err := waitPostmigrate(cctx, q); err != nil {
				return stats, err
			}
			var mirrorMS, continueMS int64
			if !preSwitch.IsZero() {
				mirrorMS, continueMS = mirrorEnded.Sub(preSwitch).Milliseconds(), time.Since(mirrorEnded).Milliseconds()
			}
			attrs := []any{"vm", m.ID, "downtime_ms", s.Downtime, "total_ms", s.TotalTime,
				"setup_ms", s.SetupTime, "ram_bytes", p.Memory.Transferred, "throttle_pct", s.Throttle,
				"mirror_end_ms", mirrorMS, "continue_to_completed_ms", continueMS}
			if r, l := s.RAM, lastActive.RAM; r != nil && l != nil {
				attrs = append(attrs, "remaining_at_stop", l.Remaining, "expected_downtime_ms", lastActive.ExpectedDowntime,
					"zero_pages_after_stop", r.Duplicate-l.Duplicate, "normal_pages_after_stop", r.Normal-l.Normal,
					"zero_pages", r.Duplicate, "normal_pages", r.Normal, "dirty_syncs", r.DirtySyncCount, "mbps_at_stop", l.MBps)
			}
			d.log.Info("migration stream completed", attrs...)
			p.Phase = agentapi.PhaseStopAndCopy
			progress(p)
			mirroring = false // ended at the switch
			for _, x := range mirrors {
				_ = q.run(cctx, "blockdev-del", map[string]any{"node-name": x.nbdNode}, nil)
			}
			return stats, nil
		case "failed", "cancelled":
			why := s.ErrorDesc
			if why == "" {
				why = s.Status
			}
			if ctx.Err() != nil {
				return stats, fmt.Errorf("migration of vm %s cancelled: %w", m.ID, ctx.Err())
			}
			if converge.Err() != nil {
				return stats, fmt.Errorf("migration of vm %s did not converge within %s; cancelled, it runs on the source", m.ID, out.Converge)
			}
			return stats, fmt.Errorf("migration of vm %s %s: %s", m.ID, s.Status, why)
		case "pre-switchover":
			// The guest is paused: the mirror ends in sync (a ready mirror
			// cancelled completes without pivot), then the device state goes.
			preSwitch = time.Now()
			if err := d.switchDisk(ctx, q, mirrors); err != nil {
				d.log.Warn("end the disk mirror at the switch; cancelling", "vm", m.ID, "err", err)
				cancel()
				continue
			}
			mirroring = false
			mirrorEnded = time.Now()
			if err := q.run(ctx, "migrate-continue", map[string]any{"state": "pre-switchover"}, nil); err != nil {
				cancel()
				continue
			}
		}
		if (ctx.Err() != nil || converge.Err() != nil) && !cancelled {
			cancel()
		}
		time.Sleep(migrationPoll)
	}
}

// switchDisk ends the ready mirrors in sync, without pivoting.
func (d *Driver) switchDisk(ctx context.Context, q *monitor, mirrors []diskExport) error {
	for _, x := range mirrors {
		if err := q.run(ctx, "block-job-cancel", map[string]any{"device": x.job}, nil); err != nil {
			return err
		}
	}
	for _, x := range mirrors {
		ended := false
		for range 3000 {
			j, err := q.blockJob(ctx, x.job)
			if err != nil {
				return err
			}
			if j == nil {
				ended = true
				break
			}
			time.Sleep(time.Millisecond)
		}
		if !ended {
			return fmt.Errorf("the mirror of %s did not end within 3 s", x.what)
		}
	}
	return nil
}

// diskExport is one disk a live migration mirrors: the target exports it
// over NBD (export), the source mirrors its node there through its NBD
// node nbdNode with job job. The overlay moves with sync=top (its base is
// the image both agents have); a read-write volume with sync=full into
// the empty copy the control plane made on the target (its frozen bases,
// if any, are flattened into it).
type diskExport struct {
	what, job, nbdNode, export, sync string
	node                             func(context.Context, *monitor) (string, error)
}

// incomingExports are the disks of m that a live migration mirrors: its
// overlay (when it has a disk) and its read-write volumes. Read-only
// volumes never migrate (the agent refuses them).
func incomingExports(m *agent.Machine) []diskExport {
	var out []diskExport
	if m.DiskMiB > 0 {
		out = append(out, diskExport{what: "its disk", job: mirrorJob, nbdNode: mirrorNode, export: nbdExport, sync: "top", node: diskNode})
	}
	for _, v := range m.Volumes {
		if v.ReadOnly {
			continue
		}
		out = append(out, diskExport{what: "volume " + v.ID, job: "mig-" + volumeNode(v), nbdNode: "mig-nbd-" + v.Serial,
			export: volumeNode(v), sync: "full",
			node: func(ctx context.Context, q *monitor) (string, error) { return activeVolumeNode(ctx, q, v) }})
	}
	return out
}

// listenAbstract listens on a fresh abstract unix socket for the source's
// NBD client; it returns the listener and the name QEMU connects to.
func listenAbstract(id string) (*net.UnixListener, string, error) {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		return nil, "", err
	}
	name := "kvm-mig-" + hex.EncodeToString(b)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	if err != nil {
		return nil, "", fmt.Errorf("vm %s: listen for its mirror: %w", id, err)
	}
	return l, name, nil
}

// fromPID says whether the unix connection c comes from process pid.
func fromPID(c net.Conn, pid int) bool {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return false
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return false
	}
	var cred *unix.Ucred
	_ = raw.Control(func(fd uintptr) {
		cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	return err == nil && cred != nil && int(cred.Pid) == pid
}

// OutgoingState asks the source's QEMU about its last migration.
func (d *Driver) OutgoingState(ctx context.Context, m *agent.Machine) (string, agentapi.Migration) {
	if alive, _ := checkProcess(m.Process, pidfileOf(m)); !alive {
		return agent.OutgoingNone, agentapi.Migration{}
	}
	var s qmpMigrationStats
	if err := d.withMonitor(ctx, m, func(q *monitor) error { return q.run(ctx, "query-migrate", nil, &s) }); err != nil {
		return agent.OutgoingActive, agentapi.Migration{}
	}
	w := s.wire("")
	switch s.Status {
	case "completed":
		return agent.OutgoingCompleted, w
	case "failed", "cancelled":
		return agent.OutgoingFailed, w
	case "":
		return agent.OutgoingNone, w
	}
	return agent.OutgoingActive, w
}

// ResumeOutgoing continues the source's QEMU after a completed stream that
// the target did not take (cont re-activates its disk).
func (d *Driver) ResumeOutgoing(ctx context.Context, m *agent.Machine) error {
	return d.withMonitor(ctx, m, func(q *monitor) error {
		st, err := q.queryStatus(ctx)
		if err != nil {
			return err
		}
		if st.Running {
			return nil
		}
		if !strings.Contains("postmigrate paused finish-migrate", st.Status) {
			return fmt.Errorf("qemu run state %s", st.Status)
		}
		return q.cont(ctx)
	})
}
