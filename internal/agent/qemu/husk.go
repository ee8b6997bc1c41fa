package qemu

// Husks: QEMU processes started ahead of time, ready to receive a snapshot.
//
// A child started cold (Spawn in snapshot.go) pays for its QEMU process and,
// above all, for faulting in and zeroing its guest RAM while it loads the
// memory state: under TCG that is ~0.8 s of CPU for a 256 MiB guest, and
// several children of one fork start at once. A husk is a QEMU started
// exactly as a child of its shape would be (same machine, kernel, devices,
// PCI addresses), with -mem-prealloc (its RAM is touched while idle), with
// -incoming defer, and with a blank disk overlay opened without a backing
// file. A spawn that finds a husk of its shape:
//
//  1. rewrites the overlay's header to name the snapshot's frozen disk
//     (qemu-img rebase -u: the husk's image is inactive until the state is
//     loaded, QEMU holds no lock on it and re-reads its header then);
//  2. QMP blockdev-add opens the frozen disk, blockdev-reopen makes it the
//     overlay's backing node;
//  3. moves the husk's files (disk, console, QMP socket) into the VM's
//     directory and leaves a symlink husks/<id> -> ../vms/<vm>, so that the
//     paths on QEMU's command line (pid file, disk, which QEMU reopens by
//     name when it activates the image) still lead to them;
//  4. QMP migrate-incoming "exec:cat memory.state", waits, cont.
//
// A husk is handed out once (taken from the ready list under the lock) and
// never comes back; a failed handover kills it and the spawn boots cold.
// Husks are kept per shape (image, vcpus, memory, disk) for the shapes this
// driver snapshotted or spawned, Options.Husks per shape, started one at a
// time at nice 10. Close kills the husks that are ready; husks a previous
// agent left (a husks/<id> that is still a directory) are killed when the
// driver first sees the state directory. The handed-out child is a VM like
// any other: its Process.LaunchDir names the husk path, as for a warm VM.

import (
	"context"
	"errors"
	"fmt"
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
)

const (
	huskDirName   = "husks"
	huskNodeName  = "husk-disk"
	huskFileNode  = "husk-file"
	huskNice      = 10
	maxHuskShapes = 4
	// huskRetry is how long the filler waits after a husk failed to start.
	huskRetry = 10 * time.Second
)

type huskKey struct {
	image             string
	vcpus, mem, diskM int64
}

type husk struct {
	key  huskKey
	dir  string // <state>/husks/<id>
	proc agent.Process
}

// huskPool holds the ready husks and the one filler goroutine, which Close
// stops.
type huskPool struct {
	d    *Driver
	per  int
	mu   sync.Mutex
	st   string // the agent's state directory, learnt from the first snapshot or spawn
	want []huskKey
	//  ready husks per shape, oldest first
	ready  map[huskKey][]*husk
	wake   chan struct{}
	stop   chan struct{}
	done   chan struct{}
	seq    atomic.Int64
	closed bool
}

func newHuskPool(d *Driver, per int) *huskPool {
	return &huskPool{d: d, per: per, ready: map[huskKey][]*husk{}, wake: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{})}
}

func keyOf(m *agent.Machine) huskKey { return huskKey{m.Image, m.VCPUs, m.MemoryMiB, m.DiskMiB} }

// stateDirOf is the agent's state directory: VM and snapshot directories
// are <state>/vms/<id> and <state>/snapshots/<id>.
func stateDirOf(dir string) string { return filepath.Dir(filepath.Dir(dir)) }

// note records that shape k is wanted (a VM of it was snapshotted or
// spawned here) and starts the filler on first use.
func (p *huskPool) note(k huskKey, stateDir string) {
	if p == nil || p.per <= 0 {
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	first := p.st == ""
	if first {
		p.st = stateDir
	}
	found := false
	for _, w := range p.want {
		found = found || w == k
	}
	if !found {
		p.want = append(p.want, k)
		if len(p.want) > maxHuskShapes {
			old := p.want[0]
			p.want = p.want[1:]
			for _, h := range p.ready[old] {
				defer p.d.killHusk(h)
			}
			delete(p.ready, old)
		}
	}
	p.mu.Unlock()
	if first {
		p.d.killOrphanHusks(filepath.Join(stateDir, huskDirName))
		removeDanglingLinks(filepath.Join(stateDir, huskDirName))
		go p.fill()
	}
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// take hands out a ready husk of shape k, at most once.
func (p *huskPool) take(k huskKey) *husk {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	hs := p.ready[k]
	if len(hs) == 0 {
		return nil
	}
	h := hs[0]
	p.ready[k] = hs[1:]
	return h
}

// missing is a shape with fewer ready husks than wanted.
func (p *huskPool) missing() (huskKey, string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return huskKey{}, "", false
	}
	for _, k := range p.want {
		if len(p.ready[k]) < p.per {
			return k, p.st, true
		}
	}
	return huskKey{}, "", false
}

func (p *huskPool) fill() {
	defer close(p.done)
	for {
		k, st, ok := p.missing()
		if ok {
			removeDanglingLinks(filepath.Join(st, huskDirName))
			ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
			h, err := p.d.startHusk(ctx, k, filepath.Join(st, huskDirName, "h"+strconv.FormatInt(time.Now().UnixNano(), 36)+"-"+strconv.FormatInt(p.seq.Add(1), 10)))
			cancel()
			if err == nil {
				p.mu.Lock()
				keep := !p.closed
				if keep {
					p.ready[k] = append(p.ready[k], h)
				}
				p.mu.Unlock()
				if !keep {
					p.d.killHusk(h)
					return
				}
				continue
			}
			p.d.log.Warn("start a husk (a qemu ready to receive a snapshot) failed; children start cold", "image", k.image, "err", err)
			select {
			case <-p.stop:
				return
			case <-time.After(huskRetry):
			}
			continue
		}
		select {
		case <-p.stop:
			return
		case <-p.wake:
		}
	}
}

// close stops the filler and kills the ready husks.
func (p *huskPool) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	started := p.st != ""
	var hs []*husk
	for _, l := range p.ready {
		hs = append(hs, l...)
	}
	p.ready = map[huskKey][]*husk{}
	p.mu.Unlock()
	close(p.stop)
	if started {
		<-p.done
	}
	for _, h := range hs {
		p.d.killHusk(h)
	}
}

// Close stops the husk filler and ends the husks that were never handed
// out. VMs keep running.
func (d *Driver) Close() error {
	d.husks.close()
	return nil
}

func huskMachine(k huskKey, dir string) *agent.Machine {
	return &agent.Machine{ID: "husk-" + filepath.Base(dir), Dir: dir, Image: k.image, VCPUs: k.vcpus, MemoryMiB: k.mem, DiskMiB: k.diskM}
}

// startHusk starts one husk in dir (see the file comment).
func (d *Driver) startHusk(ctx context.Context, k huskKey, dir string) (*husk, error) {
	img, err := d.loadImage(k.image)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, err
	}
	m := huskMachine(k, dir)
	h := &husk{key: k, dir: dir}
	fail := func(err error) (*husk, error) {
		d.killHusk(h)
		return nil, fmt.Errorf("husk %s: %w", dir, err)
	}
	if k.diskM > 0 {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		out, err := exec.CommandContext(cctx, d.qemuImg, "create", "-q", "-f", "qcow2", filepath.Join(dir, diskFileName),
			strconv.FormatInt(k.diskM, 10)+"M").CombinedOutput()
		cancel()
		if err != nil {
			return fail(fmt.Errorf("qemu-img create: %w: %s", err, strings.TrimSpace(string(out))))
		}
	}
	args := d.args(m, img, agent.BootOptions{Incoming: "-"})
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "-incoming":
			args[i+1] = "defer"
		case "-drive":
			// Opened without its backing file, which the spawn sets.
			args[i+1] = "if=none,id=" + driveID + ",driver=qcow2,discard=unmap,node-name=" + huskNodeName +
				",file.driver=file,file.node-name=" + huskFileNode + ",file.filename=" + filepath.Join(dir, diskFileName) + ",backing="
		}
	}
	args = append(args, "-mem-prealloc")
	cmd := exec.CommandContext(ctx, "nice", append([]string{"-n", strconv.Itoa(huskNice), d.qemu}, args...)...)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.WaitDelay = 5 * time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("start qemu: %v: %s", err, strings.TrimSpace(string(out))))
	}
	b, err := os.ReadFile(filepath.Join(dir, pidFileName))
	if err != nil {
		return fail(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fail(err)
	}
	_, start, err := procStat(pid)
	if err != nil {
		return fail(err)
	}
	h.proc = agent.Process{PID: pid, StartTime: start}
	var st qmpStatus
	if err := qmp(ctx, filepath.Join(dir, qmpFileName), "query-status", nil, &st); err != nil {
		return fail(err)
	}
	if st.Status != "inmigrate" {
		return fail(fmt.Errorf("qemu run state %s, want inmigrate", st.Status))
	}
	d.log.Debug("husk ready", "dir", dir, "pid", pid)
	return h, nil
}

// killHusk ends a husk that was never handed out and removes its directory.
func (d *Driver) killHusk(h *husk) {
	pidfile := filepath.Join(h.dir, pidFileName)
	procs := findProcesses(pidfile)
	if h.proc.PID != 0 {
		procs = append(procs, h.proc)
	}
	for _, p := range procs {
		if err := killProcess(p, pidfile); err != nil {
			d.log.Error("kill husk", "dir", h.dir, "pid", p.PID, "err", err)
		}
	}
	if fi, err := os.Lstat(h.dir); err == nil && fi.IsDir() {
		_ = os.RemoveAll(h.dir)
	}
}

// killOrphanHusks ends the husks a previous agent left in dir: a husk that
// was handed out is a symlink there (kept while its VM lives), a directory
// is a husk never handed out.
func (d *Driver) killOrphanHusks(dir string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		fi, err := os.Lstat(path)
		if err != nil {
			continue
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			continue // a VM's (removeDanglingLinks drops those of deleted VMs)
		}
		d.log.Info("killing a husk left by an earlier agent", "dir", path)
		d.killHusk(&husk{dir: path})
	}
}

// removeDanglingLinks removes the links husks/<id> -> ../vms/<vm> whose VM
// was deleted.
func removeDanglingLinks(dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Type()&os.ModeSymlink == 0 {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, e.Name())); errors.Is(err, os.ErrNotExist) {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

// spawnHusk starts m from the snapshot in dir with a ready husk. false
// means none was used: nothing of m exists but its directory, and the
// caller starts it cold.
func (d *Driver) spawnHusk(ctx context.Context, m *agent.Machine, dir string, files agent.SnapshotFiles) bool {
	h := d.husks.take(keyOf(m))
	if h == nil {
		return false
	}
	t0 := time.Now()
	steps, err := d.handHusk(ctx, h, m, dir, files)
	if err != nil {
		d.log.Warn("husk unusable; killed, the vm starts cold", "vm", m.ID, "husk", h.dir, "err", err)
		d.killHusk(h)
		if fi, lerr := os.Lstat(h.dir); lerr == nil && fi.Mode()&os.ModeSymlink != 0 {
			_ = os.Remove(h.dir)
		}
		for _, f := range []string{diskFileName, qmpFileName} {
			_ = os.Remove(filepath.Join(m.Dir, f))
		}
		m.Process, m.Disk = agent.Process{}, ""
		return false
	}
	d.log.Info("vm continued from snapshot in a husk", "vm", m.ID, "husk", h.dir, "pid", m.Process.PID,
		"disk_ms", steps[0].Milliseconds(), "load_ms", steps[1].Milliseconds(), "total_ms", time.Since(t0).Milliseconds())
	return true
}

// handHusk does the steps of the file comment; it returns how long the disk
// steps (1-3) and the load (4) took.
func (d *Driver) handHusk(ctx context.Context, h *husk, m *agent.Machine, dir string, files agent.SnapshotFiles) ([2]time.Duration, error) {
	var took [2]time.Duration
	t0 := time.Now()
	err := d.attachHusk(ctx, h, m, dir, files)
	took[0] = time.Since(t0)
	if err != nil {
		return took, err
	}
	m.Process = h.proc
	m.Process.LaunchDir = h.dir
	if err := qmp(ctx, qmpPathOf(m), "migrate-incoming", map[string]any{"uri": "exec:cat " + shellQuote(filepath.Join(dir, files.Memory))}, nil); err != nil {
		return took, err
	}
	if err := d.waitIncoming(ctx, m); err != nil {
		return took, err
	}
	took[1] = time.Since(t0) - took[0]
	if err := qmp(ctx, qmpPathOf(m), "cont", nil, nil); err != nil {
		return took, fmt.Errorf("continue after loading the snapshot: %w", err)
	}
	if err := d.SetNice(m, 0); err != nil {
		d.log.Warn("give a vm started in a husk its normal priority back; it runs below other vms", "vm", m.ID, "err", err)
	}
	return took, nil
}

// attachHusk gives husk h the VM's disk and moves its files into m.Dir.
func (d *Driver) attachHusk(ctx context.Context, h *husk, m *agent.Machine, dir string, files agent.SnapshotFiles) error {
	sock := filepath.Join(h.dir, qmpFileName)
	if alive, why := checkProcess(h.proc, filepath.Join(h.dir, pidFileName)); !alive {
		return errors.New(why)
	}
	m.Disk = ""
	if m.DiskMiB > 0 {
		if files.Disk == "" {
			return fmt.Errorf("the snapshot has no disk, the vm has %d MiB", m.DiskMiB)
		}
		frozen := filepath.Join(dir, files.Disk)
		// Relative to the VM's directory, which sits at the husk's depth.
		backing, err := filepath.Rel(m.Dir, frozen)
		if err != nil {
			return err
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		out, err := exec.CommandContext(cctx, d.qemuImg, "rebase", "-u", "-f", "qcow2", "-b", backing, "-F", "qcow2",
			filepath.Join(h.dir, diskFileName)).CombinedOutput()
		cancel()
		if err != nil {
			return fmt.Errorf("qemu-img rebase: %w: %s", err, strings.TrimSpace(string(out)))
		}
		if err := qmp(ctx, sock, "blockdev-add", map[string]any{
			"driver": "qcow2", "node-name": "frozen", "read-only": true,
			"file": map[string]any{"driver": "file", "filename": frozen, "read-only": true},
		}, nil); err != nil {
			return err
		}
		if err := qmp(ctx, sock, "blockdev-reopen", map[string]any{"options": []any{map[string]any{
			"driver": "qcow2", "node-name": huskNodeName, "discard": "unmap", "file": huskFileNode, "backing": "frozen",
		}}}, nil); err != nil {
			return err
		}
	}
	// The husk's files become the VM's; its directory becomes a link to
	// the VM's, where the names on QEMU's command line still lead.
	for _, f := range []string{diskFileName, consoleFileName, qmpFileName} {
		if err := os.Rename(filepath.Join(h.dir, f), filepath.Join(m.Dir, f)); err != nil && (f != diskFileName || m.DiskMiB > 0) {
			return fmt.Errorf("move husk file %s: %w", f, err)
		}
	}
	_ = os.Remove(filepath.Join(h.dir, pidFileName))
	if err := os.Remove(h.dir); err != nil {
		return fmt.Errorf("remove husk directory: %w", err)
	}
	if err := os.Symlink(filepath.Join("..", filepath.Base(filepath.Dir(m.Dir)), filepath.Base(m.Dir)), h.dir); err != nil {
		return fmt.Errorf("link husk directory to the vm's: %w", err)
	}
	return nil
}
