package agent

// Taking a snapshot of a VM on this agent.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// CreateSnapshot takes snapshot id of a running (or paused) VM, or returns
// the snapshot when it exists: a retried or concurrent PUT waits for the
// first and never pauses the VM again. The bool is true when this call took it.
func (a *Agent) CreateSnapshot(ctx context.Context, id string, spec agentapi.SnapshotSpec) (agentapi.Snapshot, bool, error) {
	if err := checkSnapshotID(id); err != nil {
		return agentapi.Snapshot{}, false, err
	}
	if spec.VMID == "" {
		return agentapi.Snapshot{}, false, errInvalid("vm_id is required: the id of the vm to snapshot")
	}
	if err := checkID(spec.VMID); err != nil {
		return agentapi.Snapshot{}, false, err
	}
	sn, err := a.snapshotter()
	if err != nil {
		return agentapi.Snapshot{}, false, err
	}
	for {
		s := a.snaps.entry(id)
		if err := s.lock(ctx); err != nil {
			return agentapi.Snapshot{}, false, err
		}
		rec, corrupt, gone := s.state()
		switch {
		case gone:
			s.unlock()
			continue
		case corrupt != "":
			s.unlock()
			return agentapi.Snapshot{}, false, errConflict("snapshot %s exists but %s", id, corrupt)
		case rec != nil:
			s.unlock()
			if rec.VMID != spec.VMID {
				e := errConflict("snapshot %s already exists, of vm %s, not of vm %s; choose another snapshot id", id, rec.VMID, spec.VMID)
				e.Details = map[string]any{"id": id, "vm_id": rec.VMID}
				return agentapi.Snapshot{}, false, e
			}
			return rec.wire(), false, nil
		}
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), snapshotTimeout)
		rec, err := a.takeSnapshot(tctx, sn, id, spec)
		cancel()
		if err != nil {
			a.snaps.drop(s)
			s.unlock()
			return agentapi.Snapshot{}, false, err
		}
		s.set(rec)
		s.unlock()
		return rec.wire(), true, nil
	}
}

// takeSnapshot snapshots the VM into a partial directory, describes the
// files, writes the metadata and renames the directory into place. The
// caller holds the snapshot's lock.
func (a *Agent) takeSnapshot(ctx context.Context, sn Snapshotter, id string, spec agentapi.SnapshotSpec) (*snapshotRecord, error) {
	e, err := a.lockVM(ctx, spec.VMID, "be snapshotted")
	if err != nil {
		return nil, err
	}
	locked := true
	defer func() {
		if locked {
			e.unlock()
		}
	}()
	r := a.refreshLocked(ctx, e)
	if r.State != agentapi.StateRunning && r.State != agentapi.StatePaused {
		err := errConflict("vm %s is %s: only a running or paused vm can be snapshotted; start it first", r.ID, r.State)
		err.Details = map[string]any{"vm_id": r.ID, "state": r.State}
		return nil, err
	}
	partial, err := os.MkdirTemp(a.snapsDir(), partialPrefix+id+"-")
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	done := false
	defer func() {
		if !done {
			if err := os.RemoveAll(partial); err != nil {
				a.log.Warn("remove unfinished snapshot", "snapshot", id, "dir", partial, "err", err)
			}
		}
	}()
	// The chain this snapshot freezes is at most the depth long: flattened
	// now if the flatten after the last snapshot has not run yet. One that
	// fails leaves a longer chain, which children here can use; a peer
	// refuses to pull it (snapshot_pull.go), and says why.
	if err := a.flattenLocked(ctx, r); err != nil {
		a.log.Warn("snapshot of a vm whose disk chain could not be flattened", "snapshot", id, "vm", r.ID,
			"depth", a.cfg.DiskChainDepth, "err", err)
	}
	m := machineOf(a, r)
	// The frozen points of its volumes (volume_fork.go): step 1 now, the
	// switch by the driver in the paused window, the rest after.
	vols, err := a.freezeVolumes(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	opts := SnapshotOptions{
		Volumes:    vols.switches(a),
		KeepPaused: spec.PauseSource || r.State == agentapi.StatePaused,
		RecordDisk: func(disk string) error {
			next, _, _ := e.state()
			next.Disk = disk
			if err := a.saveRecord(&next); err != nil {
				return err
			}
			e.set(next)
			return nil
		},
	}
	start := time.Now()
	files, err := sn.Snapshot(ctx, m, partial, opts)
	window := time.Since(start)
	if err == nil && len(files.SwitchedVolumes) != len(opts.Volumes) {
		err = fmt.Errorf("%w: it moved %v of %d", errNoFreeze, files.SwitchedVolumes, len(opts.Volumes))
	}
	snapVols := vols.finish(a, r, files.SwitchedVolumes)
	// Whatever happened, record what the VM is now.
	after := a.refreshLocked(ctx, e)
	if err != nil {
		a.collectBases() // those of volumes recorded back
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	e.unlock()
	locked = false

	rec := &snapshotRecord{
		Version: snapshotVersion, ID: id, VMID: r.ID, Image: r.Image, VCPUs: r.VCPUs,
		MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB, CreatedAt: time.Now().UTC().Truncate(time.Millisecond),
		NICs: guestView(r), SeedDisk: r.Seed != nil, GuestAgent: r.GuestAgent, FSFrozen: files.FSFrozen, SecureBoot: r.SecureBoot,
		Volumes: snapVols,
	}
	if r.firmware() == agentapi.FirmwareUEFI {
		rec.Firmware = agentapi.FirmwareUEFI
	}
	if files.Disk != "" {
		// The frozen disk sits on the disk of the snapshot the VM came from.
		rec.Parent = r.Snapshot
	}
	if rec.Files, err = a.describeFiles(partial, files); err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	if err := a.commitSnapshotDir(partial, rec); err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	done = true
	// The VM writes to a new file on the chain the snapshot froze.
	if countDiskFiles(rec.Files)+1 > a.cfg.DiskChainDepth {
		a.flattenLater(r.ID)
	}
	w := rec.wire()
	a.log.Info("snapshot taken", "snapshot", id, "vm", r.ID, "vm_state", after.State, "disk", after.Disk,
		"paused_ms", window.Milliseconds(), "total_ms", time.Since(start).Milliseconds(), "bytes", w.SizeBytes)
	return rec, nil
}

// describeFiles sizes and hashes the snapshot's files, and syncs them.
func (a *Agent) describeFiles(dir string, files SnapshotFiles) ([]agentapi.SnapshotFile, error) {
	if files.Memory == "" {
		return nil, errors.New("the driver made no memory file")
	}
	list := []agentapi.SnapshotFile{{Name: files.Memory, Kind: agentapi.SnapshotFileMemory}}
	if files.RAM != "" {
		list = append(list, agentapi.SnapshotFile{Name: files.RAM, Kind: agentapi.SnapshotFileRAM, BLAKE3: files.RAMDigest})
	}
	if files.Disk != "" {
		list = append(list, agentapi.SnapshotFile{Name: files.Disk, Kind: agentapi.SnapshotFileDisk})
	}
	for _, b := range files.Backing {
		list = append(list, agentapi.SnapshotFile{Name: b, Kind: agentapi.SnapshotFileBacking})
	}
	if files.Vars != "" {
		list = append(list, agentapi.SnapshotFile{Name: files.Vars, Kind: agentapi.SnapshotFileVars})
	}
	for i := range list {
		_, known := ramHash(list[i])
		size, sum, err := digestFile(filepath.Join(dir, list[i].Name), list[i], known)
		if err != nil {
			return nil, err
		}
		list[i].SizeBytes = size
		setDigest(&list[i], sum)
	}
	return list, nil
}

// digestFile sizes one snapshot file and takes the digest its metadata f
// records (ramHash): a RAM image's of its sparse form, unless known.
func digestFile(path string, meta agentapi.SnapshotFile, known string) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return 0, "", err
	}
	newHash, _ := ramHash(meta)
	n, sum := fi.Size(), known
	switch {
	case meta.Kind == agentapi.SnapshotFileRAM && sum == "":
		sum, err = SparseDigest(f, n, newHash)
	case meta.Kind != agentapi.SnapshotFileRAM:
		h := newHash()
		n, err = io.Copy(h, f)
		sum = digestOf(h)
	}
	if err != nil {
		return 0, "", fmt.Errorf("read %s: %w", path, err)
	}
	return n, sum, nil
}

// commitSnapshotDir writes the metadata into the finished directory dir and
// renames it to the snapshot's place: from then on the snapshot exists. Its
// files are synced to disk in the background (snapshot_sync.go).
func (a *Agent) commitSnapshotDir(dir string, rec *snapshotRecord) error {
	rec.Unsynced = !a.cfg.NoSync
	if err := a.writeSnapshotMeta(dir, rec); err != nil {
		return fmt.Errorf("write snapshot metadata: %w", err)
	}
	if err := os.Rename(dir, a.snapDir(rec.ID)); err != nil {
		return fmt.Errorf("move the snapshot into place: %w", err)
	}
	if a.cfg.NoSync {
		return nil
	}
	if err := syncDir(a.snapsDir()); err != nil {
		return err
	}
	a.syncLater(rec)
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}
