package agent

// Creating, reading, growing and deleting volumes (volume.go).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// volumeTimeout bounds making a volume's disk (a copy of an image's disk
// can take a while): it goes on when the caller gives up, so that a retry
// finds the volume instead of a second copy.
const volumeTimeout = 10 * time.Minute

type volEntry = entry[*volumeRecord]

// CreateVolume makes volume id, or returns it when it exists with the same
// spec (201 or 200 for the handler, by created). Another spec is a 409.
func (a *Agent) CreateVolume(ctx context.Context, id string, spec agentapi.VolumeSpec) (agentapi.Volume, bool, error) {
	if err := checkVolumeID(id); err != nil {
		return agentapi.Volume{}, false, err
	}
	if err := checkVolumeSize(spec.SizeMiB); err != nil {
		return agentapi.Volume{}, false, err
	}
	if s := spec.Source; s != nil {
		given := 0
		for _, set := range []bool{s.Image != "", s.Volume != "", s.Peer != nil} {
			if set {
				given++
			}
		}
		if s.Snapshot != "" {
			// A fork child's volume: a volume of the snapshot, here or on
			// the peer.
			if err := checkSnapshotID(s.Snapshot); err != nil {
				return agentapi.Volume{}, false, err
			}
			if s.Volume == "" || s.Image != "" {
				return agentapi.Volume{}, false, errInvalid("source.snapshot needs source.volume (a volume of the snapshot) and no image")
			}
			if s.Peer != nil {
				given-- // volume and peer name one source together
			}
		}
		switch {
		case given > 1:
			return agentapi.Volume{}, false, errInvalid("source names more than one of image, volume and peer: give one")
		case given == 0:
			spec.Source = nil
		case s.Volume == id:
			return agentapi.Volume{}, false, errInvalid("volume %s cannot be a clone of itself", id)
		case s.Volume != "":
			if err := checkVolumeID(s.Volume); err != nil {
				return agentapi.Volume{}, false, err
			}
		}
	}
	vd, err := a.volumer()
	if err != nil {
		return agentapi.Volume{}, false, err
	}
	for {
		if e := a.vols.lookup(id); e != nil {
			if err := e.lock(ctx); err != nil {
				return agentapi.Volume{}, false, err
			}
			r, corrupt, gone := e.state()
			e.unlock()
			switch {
			case gone:
				continue
			case corrupt != "":
				return agentapi.Volume{}, false, errConflict("volume %s exists but %s", id, corrupt)
			case !sameVolumeSpec(r, spec):
				err := errConflict("volume %s already exists with another spec (%d MiB, source %s); delete it first or use another id",
					id, r.SizeMiB, describeSource(r.Source))
				err.Details = map[string]any{"id": id}
				return agentapi.Volume{}, false, err
			}
			return a.volumeWire(r), false, nil
		}
		e := a.vols.create(id)
		if e == nil {
			continue // another call created it meanwhile
		}
		// The work goes on if the caller gives up (see volumeTimeout).
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), volumeTimeout)
		r, err := a.createVolumeLocked(wctx, vd, id, spec)
		cancel()
		if err != nil {
			a.vols.drop(e)
			e.unlock()
			return agentapi.Volume{}, false, err
		}
		e.set(r)
		e.unlock()
		a.log.Info("volume created", "volume", id, "size_mib", r.SizeMiB, "source", describeSource(r.Source))
		return a.volumeWire(r), true, nil
	}
}

func sameVolumeSpec(r *volumeRecord, spec agentapi.VolumeSpec) bool {
	var have, want agentapi.VolumeSource
	var havePeer, wantPeer agentapi.VolumePeer
	if r.Source != nil {
		have = *r.Source
		if have.Peer != nil {
			havePeer = *have.Peer
		}
	}
	if spec.Source != nil {
		want = *spec.Source
		if want.Peer != nil {
			wantPeer = *want.Peer
		}
	}
	// A pulled volume is the same whatever digest the retry names: the
	// first pull checked its own.
	havePeer.Digest, wantPeer.Digest = "", ""
	return have.Image == want.Image && have.Volume == want.Volume && have.Snapshot == want.Snapshot && (have.Peer == nil) == (want.Peer == nil) &&
		havePeer == wantPeer && r.SizeMiB == spec.SizeMiB
}

func describeSource(s *agentapi.VolumeSource) string {
	switch {
	case s == nil:
		return "empty"
	case s.Image != "":
		return "image " + s.Image
	case s.Snapshot != "" && s.Peer != nil:
		return "volume " + s.Volume + " of snapshot " + s.Snapshot + " on agent " + s.Peer.Agent
	case s.Snapshot != "":
		return "volume " + s.Volume + " of snapshot " + s.Snapshot
	case s.Peer != nil:
		return "agent " + s.Peer.Agent
	default:
		return "volume " + s.Volume
	}
}

// createVolumeLocked makes the volume's directory under a partial name and
// renames it into place. The caller holds the new entry's lock.
func (a *Agent) createVolumeLocked(ctx context.Context, vd Volumer, id string, spec agentapi.VolumeSpec) (*volumeRecord, error) {
	r := &volumeRecord{Version: volumeVersion, ID: id, SizeMiB: spec.SizeMiB, Source: spec.Source,
		Disk: volumeDiskFile, CreatedAt: time.Now().UTC().Truncate(time.Millisecond)}
	partial, err := os.MkdirTemp(a.volsDir(), partialPrefix+id+"-")
	if err != nil {
		return nil, fmt.Errorf("create volume %s: %w", id, err)
	}
	done := false
	defer func() {
		if !done {
			_ = os.RemoveAll(partial)
		}
	}()
	// Not searchable by QEMU's uids: QEMU opens a volume's files as root
	// before it drops privileges, or gets them as descriptors (hot attach).
	if err := os.Chmod(partial, 0o700); err != nil {
		return nil, err
	}
	disk := filepath.Join(partial, volumeDiskFile)
	switch {
	case spec.Source != nil && spec.Source.Peer != nil:
		if err := a.pullVolume(ctx, vd, r, disk); err != nil {
			return nil, err
		}
	case spec.Source != nil && spec.Source.Snapshot != "":
		if err := a.cloneSnapshotVolume(ctx, vd, r, partial); err != nil {
			return nil, err
		}
	case spec.Source != nil && spec.Source.Volume != "":
		if err := a.cloneVolume(ctx, vd, r, partial); err != nil {
			return nil, err
		}
	case spec.Source != nil && spec.Source.Image != "":
		img, err := a.cfg.Driver.Image(spec.Source.Image)
		if errors.Is(err, ErrUnknownImage) {
			e := errInvalid("image %q does not exist on this agent; it has %v", spec.Source.Image, a.cfg.Driver.Images())
			e.Details = map[string]any{"image": spec.Source.Image}
			return nil, e
		}
		if err != nil {
			return nil, fmt.Errorf("create volume %s: image %s: %w", id, spec.Source.Image, err)
		}
		if img.BaseDiskMiB == 0 {
			return nil, errInvalid("image %s has no disk (it boots a kernel): a volume can start from an image with a disk, or empty", img.Name)
		}
		if spec.SizeMiB < img.BaseDiskMiB {
			e := errInvalid("size_mib %d is smaller than the %d MiB disk of image %s", spec.SizeMiB, img.BaseDiskMiB, img.Name)
			e.Details = map[string]any{"size_mib": spec.SizeMiB, "image_disk_mib": img.BaseDiskMiB}
			return nil, e
		}
		if err := vd.CreateVolumeDisk(ctx, disk, spec.SizeMiB, VolumeFrom{Image: img.Name}); err != nil {
			return nil, fmt.Errorf("create volume %s from image %s: %w", id, img.Name, err)
		}
	default:
		if err := vd.CreateVolumeDisk(ctx, disk, spec.SizeMiB, VolumeFrom{}); err != nil {
			return nil, fmt.Errorf("create volume %s: %w", id, err)
		}
	}
	if err := os.Chmod(filepath.Join(partial, r.Disk), 0o600); err != nil {
		return nil, err
	}
	if err := a.saveVolume(partial, r); err != nil {
		return nil, err
	}
	if err := a.afterVolumeFiles(id); err != nil {
		return nil, err
	}
	if err := os.Rename(partial, a.volDir(id)); err != nil {
		return nil, fmt.Errorf("create volume %s: %w", id, err)
	}
	done = true
	if !a.cfg.NoSync {
		if err := syncDir(a.volsDir()); err != nil {
			return nil, fmt.Errorf("create volume %s: %w", id, err)
		}
	}
	return r, nil
}

// cloneVolume makes r (in partial) a copy-on-write clone of its source:
// the source's disk is frozen into a base, and the source and r each get
// an overlay of their own on it (volume.go). The steps are ordered so
// that a crash between any two leaves the source whole and usable
// (tidyVolumeDir and collectBases remove the rest at start-up):
//
//  1. link the source's disk into .bases and make it read-only
//  2. make the source's next disk, an overlay of the base
//  3. make r's disk, an overlay of the base
//  4. record the source's move onto its overlay (the commit for it)
//  5. remove the source's old name of the base
//
// The caller renames partial into place after (the commit for r).
func (a *Agent) cloneVolume(ctx context.Context, vd Volumer, r *volumeRecord, partial string) error {
	srcID := r.Source.Volume
	src, err := a.vols.acquire(ctx, srcID)
	if err != nil {
		return err
	}
	if src == nil {
		e := errInvalid("source volume %s does not exist on this agent", srcID)
		e.Details = map[string]any{"volume": srcID}
		return e
	}
	defer src.unlock()
	sr, corrupt, _ := src.state()
	switch {
	case corrupt != "":
		return errConflict("source volume %s cannot be cloned: %s", srcID, corrupt)
	case sr == nil:
		return errInvalid("source volume %s does not exist on this agent", srcID)
	case r.SizeMiB < sr.SizeMiB:
		e := errInvalid("size_mib %d is smaller than the %d MiB of source volume %s: a clone is at least as large as its source", r.SizeMiB, sr.SizeMiB, srcID)
		e.Details = map[string]any{"size_mib": r.SizeMiB, "source_size_mib": sr.SizeMiB}
		return e
	}
	for _, u := range a.volumeUsers(srcID) {
		if u.State == agentapi.StateRunning || u.State == agentapi.StatePaused || u.State == agentapi.StateCreating {
			return errVolumeAttached(srcID, u, "a volume is cloned while no running vm writes it; stop the vm or detach the volume first")
		}
	}
	a.basesMu.Lock()
	defer a.basesMu.Unlock()
	srcDir := a.volDir(srcID)
	base := fmt.Sprintf("%s-%d.qcow2", srcID, time.Now().UnixNano())
	if err := os.Link(filepath.Join(srcDir, sr.Disk), a.basePath(base)); err != nil {
		return fmt.Errorf("clone volume %s: freeze its disk: %w", srcID, err)
	}
	if err := os.Chmod(a.basePath(base), 0o400); err != nil {
		return fmt.Errorf("clone volume %s: freeze its disk: %w", srcID, err)
	}
	next := nextVolumeDisk(sr.Disk)
	if err := vd.CreateVolumeDisk(ctx, filepath.Join(srcDir, next), sr.SizeMiB, VolumeFrom{Backing: baseRef(base)}); err != nil {
		return fmt.Errorf("clone volume %s: its new overlay: %w", srcID, err)
	}
	if err := os.Chmod(filepath.Join(srcDir, next), 0o600); err != nil {
		return err
	}
	if err := vd.CreateVolumeDisk(ctx, filepath.Join(partial, r.Disk), r.SizeMiB, VolumeFrom{Backing: baseRef(base)}); err != nil {
		return fmt.Errorf("clone volume %s: the clone's overlay: %w", srcID, err)
	}
	chain := append([]string{base}, sr.Bases...)
	moved := *sr
	moved.Disk, moved.Bases = next, chain
	if err := a.saveVolume(srcDir, &moved); err != nil {
		return err
	}
	src.set(&moved)
	if err := os.Remove(filepath.Join(srcDir, sr.Disk)); err != nil {
		a.log.Warn("remove the old name of a frozen volume disk", "volume", srcID, "file", sr.Disk, "err", err)
	}
	r.Bases = chain
	return nil
}

// nextVolumeDisk is the name of the file after disk: disk.qcow2,
// disk.1.qcow2, disk.2.qcow2 ...
func nextVolumeDisk(disk string) string {
	var g int
	if _, err := fmt.Sscanf(disk, "disk.%d.qcow2", &g); err != nil {
		g = 0
	}
	return fmt.Sprintf("disk.%d.qcow2", g+1)
}

// afterVolumeFiles is a fault-injection point of tests: it runs once a new
// volume's files are complete, before they are renamed into place.
func (a *Agent) afterVolumeFiles(id string) error {
	if a.cfg.volumeHook != nil {
		return a.cfg.volumeHook(id)
	}
	return nil
}

func (a *Agent) volumeRecordOf(id string) (*volEntry, *volumeRecord, error) {
	if err := checkVolumeID(id); err != nil {
		return nil, nil, err
	}
	e := a.vols.lookup(id)
	if e == nil {
		return nil, nil, errVolumeNotFound(id)
	}
	r, corrupt, gone := e.state()
	switch {
	case gone || (r == nil && corrupt == ""):
		return nil, nil, errVolumeNotFound(id)
	case corrupt != "":
		return nil, nil, errConflict("volume %s exists but %s", id, corrupt)
	}
	return e, r, nil
}

// GetVolume returns one volume.
func (a *Agent) GetVolume(_ context.Context, id string) (agentapi.Volume, error) {
	_, r, err := a.volumeRecordOf(id)
	if err != nil {
		return agentapi.Volume{}, err
	}
	return a.volumeWire(r), nil
}

// ListVolumes returns every complete volume, sorted by id.
func (a *Agent) ListVolumes(context.Context) []agentapi.Volume {
	out := []agentapi.Volume{}
	for _, e := range a.vols.all() {
		if r, corrupt, gone := e.state(); !gone && corrupt == "" && r != nil {
			out = append(out, a.volumeWire(r))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// DeleteVolume removes volume id and its file (its bases go when no
// other volume names them); an unknown id is not an error, an attached
// volume is a 409 naming the VM.
func (a *Agent) DeleteVolume(ctx context.Context, id string) error {
	if err := checkVolumeID(id); err != nil {
		return err
	}
	e, err := a.vols.acquire(ctx, id)
	if e == nil || err != nil {
		return err
	}
	defer e.unlock()
	if r, corrupt, _ := e.state(); r == nil && corrupt == "" {
		return nil
	}
	if users := a.volumeUsers(id); len(users) > 0 {
		return errVolumeAttached(id, users[0], "detach it (or delete the vm) first")
	}
	trash := filepath.Join(a.volsDir(), fmt.Sprintf("%s%s-%d", trashPrefix, id, time.Now().UnixNano()))
	if err := os.Rename(a.volDir(id), trash); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove volume %s: %w", id, err)
	}
	if err := os.RemoveAll(trash); err != nil {
		a.log.Warn("remove files of deleted volume", "volume", id, "dir", trash, "err", err)
	}
	a.vols.drop(e)
	a.collectBases()
	a.log.Info("volume deleted", "volume", id)
	return nil
}

// ResizeVolume grows volume id to sizeMiB: online (the guest sees it)
// when it is attached to a running or paused VM. Smaller is a 400; the
// same size changes nothing.
func (a *Agent) ResizeVolume(ctx context.Context, id string, sizeMiB int64) (agentapi.Volume, error) {
	if err := checkVolumeSize(sizeMiB); err != nil {
		return agentapi.Volume{}, err
	}
	if _, _, err := a.volumeRecordOf(id); err != nil {
		return agentapi.Volume{}, err
	}
	vd, err := a.volumer()
	if err != nil {
		return agentapi.Volume{}, err
	}
	// VM first, then volume (volume.go): the VM it is attached to, if any,
	// is locked so that its QEMU is not started or stopped meanwhile.
	var vmE *vmEntry
	users := a.volumeUsers(id)
	for _, u := range users {
		if u.ReadOnly && isUp(u.State) {
			return agentapi.Volume{}, errVolumeAttached(id, u, "a volume grows while no vm has it read-only; detach it or stop the vm first")
		}
	}
	if len(users) > 0 {
		if vmE, err = a.lockVM(ctx, users[0].VM, "grow its volume"); err != nil {
			return agentapi.Volume{}, err
		}
		defer vmE.unlock()
	}
	e, err := a.vols.acquire(ctx, id)
	if err != nil {
		return agentapi.Volume{}, err
	}
	if e == nil {
		return agentapi.Volume{}, errVolumeNotFound(id)
	}
	defer e.unlock()
	r, corrupt, _ := e.state()
	switch {
	case corrupt != "":
		return agentapi.Volume{}, errConflict("volume %s exists but %s", id, corrupt)
	case r == nil:
		return agentapi.Volume{}, errVolumeNotFound(id)
	case sizeMiB == r.SizeMiB:
		return a.volumeWire(r), nil
	case sizeMiB < r.SizeMiB:
		e := errInvalid("size_mib %d is smaller than volume %s's %d MiB: volumes grow, never shrink", sizeMiB, id, r.SizeMiB)
		e.Details = map[string]any{"size_mib": sizeMiB, "current_size_mib": r.SizeMiB}
		return agentapi.Volume{}, e
	}
	online := false
	if vmE != nil {
		vr := a.refreshLocked(ctx, vmE)
		for _, v := range vr.Volumes {
			if v.ID != id || (vr.State != agentapi.StateRunning && vr.State != agentapi.StatePaused) {
				continue
			}
			mv, _ := a.machineVolume(v)
			if err := vd.ResizeAttachedVolume(ctx, machineOf(a, vr), mv, sizeMiB); err != nil {
				return agentapi.Volume{}, fmt.Errorf("grow volume %s on vm %s to %d MiB: %w", id, vr.ID, sizeMiB, err)
			}
			online = true
		}
	}
	if !online {
		if err := vd.ResizeVolumeDisk(ctx, filepath.Join(a.volDir(id), r.Disk), sizeMiB); err != nil {
			return agentapi.Volume{}, fmt.Errorf("grow volume %s to %d MiB: %w", id, sizeMiB, err)
		}
	}
	grown := *r
	grown.SizeMiB = sizeMiB
	if err := a.saveVolume(a.volDir(id), &grown); err != nil {
		return agentapi.Volume{}, err
	}
	e.set(&grown)
	a.log.Info("volume grown", "volume", id, "from_mib", r.SizeMiB, "to_mib", sizeMiB, "online", online)
	return a.volumeWire(&grown), nil
}
