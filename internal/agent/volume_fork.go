package agent

// Volumes of a snapshot (issue 26, forks): a snapshot of a VM with
// volumes takes a frozen point of each read-write volume in the same
// paused window as the VM's memory and disk, so that a database's files
// match its memory in every child.
//
// The frozen point is the volume's current file, frozen into a base of
// volumes/.bases exactly as a copy-on-write clone freezes its source
// (volume_create.go), only with the VM still running on it:
//
//  1. (VM and volumes locked, before the pause) link the volume's disk
//     into .bases and make it read-only; make the volume's next disk, an
//     overlay of the base; record the volume's move onto it (its record
//     names the overlay on the base, which reads the same as the file the
//     VM still writes, so a crash from here on loses nothing);
//  2. (paused, inside the guest agent's fsfreeze) the driver moves the
//     running VM's disk of the volume onto the overlay
//     (SnapshotOptions.Volumes; QEMU: blockdev-add + blockdev-snapshot),
//     and nothing writes the base again;
//  3. the snapshot's metadata names the base chain of each volume
//     (snapshotVolume.Bases): a base is kept while a volume's record or a
//     snapshot's names it (collectBases), so a child can be made from the
//     frozen point until the snapshot is deleted, whatever happens to the
//     source volume.
//
// A volume the driver did not move (a failed snapshot) is recorded back
// onto its file; one it moved stays on its overlay.
//
// A child's volume is a new volume (PUT /v1/volumes/{id} with source
// {snapshot, volume}): on the snapshot's agent an overlay of the frozen
// point, on another agent a copy pulled from the snapshot's agent
// (GET /v1/snapshots/{id}/volumes/{volume}/content, the frozen chain as one
// qcow2, checked against its sha256 while it streams). The child attaches
// it in the slot the source volume had, so that its devices match the
// saved state.
//
// A read-only volume has no frozen point: nothing writes it while it is
// attached read-only. The children attach the same volume read-only, so
// they share it; they can only run on its agent.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// VolumeSwitch is one read-write volume that Snapshotter.Snapshot
// freezes: in the paused window the VM's disk of Volume moves from
// Volume.Path (which is frozen from then on) onto Next, an existing
// overlay of it (its backing file names the same file, as a base).
type VolumeSwitch struct {
	Volume MachineVolume
	Next   string // absolute path
}

// snapshotVolume is one volume of a snapshot's source VM, in
// snapshot.json.
type snapshotVolume struct {
	ID       string `json:"id"`
	SizeMiB  int64  `json:"size_mib"`
	ReadOnly bool   `json:"read_only,omitempty"`
	Slot     int    `json:"slot"`
	// Frozen: the snapshot took a frozen point of it (read-write volumes).
	Frozen bool `json:"frozen,omitempty"`
	// Bases is the frozen point on this agent: its chain of files in
	// volumes/.bases, top first. Empty on an agent that pulled the
	// snapshot: the frozen point stays on the snapshot's own agent.
	Bases []string `json:"bases,omitempty"`
}

func validateSnapshotVolumes(vs []snapshotVolume) error {
	if len(vs) > MaxVolumesPerVM {
		return fmt.Errorf("%d volumes, at most %d", len(vs), MaxVolumesPerVM)
	}
	ids, slots := map[string]bool{}, map[int]bool{}
	for _, v := range vs {
		switch {
		case checkVolumeID(v.ID) != nil || ids[v.ID]:
			return fmt.Errorf("volume id %q is not valid or listed twice", v.ID)
		case v.Slot < 0 || v.Slot >= MaxVolumesPerVM || slots[v.Slot]:
			return fmt.Errorf("volume %s: slot %d is out of range or taken twice", v.ID, v.Slot)
		case v.SizeMiB < 1:
			return fmt.Errorf("volume %s: size_mib %d", v.ID, v.SizeMiB)
		case v.Frozen == v.ReadOnly:
			return fmt.Errorf("volume %s: a read-write volume has a frozen point, a read-only one none", v.ID)
		case !v.Frozen && len(v.Bases) > 0:
			return fmt.Errorf("volume %s: bases without a frozen point", v.ID)
		}
		ids[v.ID], slots[v.Slot] = true, true
		for _, b := range v.Bases {
			if !fileNamePattern.MatchString(b) {
				return fmt.Errorf("volume %s: base %q is not a plain file name", v.ID, b)
			}
		}
	}
	return nil
}

func wireSnapshotVolumes(vs []snapshotVolume) []agentapi.SnapshotVolume {
	var out []agentapi.SnapshotVolume
	for _, v := range vs {
		out = append(out, agentapi.SnapshotVolume{ID: v.ID, SizeMiB: v.SizeMiB, ReadOnly: v.ReadOnly, Slot: v.Slot, Frozen: v.Frozen})
	}
	return out
}

// pulledSnapshotVolumes are the volumes of a snapshot pulled from another
// agent: their frozen points stay there.
func pulledSnapshotVolumes(vs []agentapi.SnapshotVolume) []snapshotVolume {
	var out []snapshotVolume
	for _, v := range vs {
		out = append(out, snapshotVolume{ID: v.ID, SizeMiB: v.SizeMiB, ReadOnly: v.ReadOnly, Slot: v.Slot, Frozen: v.Frozen})
	}
	return out
}

// volumeFreeze is step 1 of one read-write volume (see the top of the
// file), until the snapshot says whether the driver moved it.
type volumeFreeze struct {
	e      *volEntry
	before *volumeRecord
	moved  *volumeRecord
	base   string
	att    vmVolume
}

// snapshotVolumes holds what a snapshot of a VM with volumes took: the
// locks of its volumes (held from step 1 to the end) and the freezes.
type snapshotVolumes struct {
	held     volumeLocks
	freezes  []*volumeFreeze
	readOnly []vmVolume
}

// freezeVolumes does step 1 for every read-write volume of VM r, whose
// lock the caller holds. With an error nothing is left changed.
func (a *Agent) freezeVolumes(ctx context.Context, r vmRecord) (*snapshotVolumes, error) {
	sv := &snapshotVolumes{}
	if len(r.Volumes) == 0 {
		return sv, nil
	}
	vd, err := a.volumer()
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(r.Volumes))
	for i, v := range r.Volumes {
		ids[i] = v.ID
	}
	held, recs, err := a.lockVolumes(ctx, ids)
	if err != nil {
		return nil, fmt.Errorf("vm %s: lock its volumes: %w", r.ID, err)
	}
	sv.held = held
	a.basesMu.Lock()
	defer a.basesMu.Unlock()
	for i, att := range r.Volumes {
		if att.ReadOnly {
			sv.readOnly = append(sv.readOnly, att)
			continue
		}
		f, err := a.freezeVolume(ctx, vd, held, recs[i], att)
		if err != nil {
			sv.undo(a)
			return nil, fmt.Errorf("vm %s: freeze volume %s: %w", r.ID, att.ID, err)
		}
		sv.freezes = append(sv.freezes, f)
	}
	return sv, nil
}

func (a *Agent) freezeVolume(ctx context.Context, vd Volumer, held volumeLocks, r *volumeRecord, att vmVolume) (*volumeFreeze, error) {
	i := slices.IndexFunc(held, func(e *volEntry) bool { return e.id == att.ID })
	if i < 0 {
		return nil, fmt.Errorf("volume %s is not locked", att.ID)
	}
	dir := a.volDir(att.ID)
	base := fmt.Sprintf("%s-%d.qcow2", att.ID, time.Now().UnixNano())
	if err := os.Link(filepath.Join(dir, r.Disk), a.basePath(base)); err != nil {
		return nil, fmt.Errorf("link its disk into the bases: %w", err)
	}
	// Read-only for every name from now on; the VM writes it through the
	// descriptor it has until the switch.
	if err := os.Chmod(a.basePath(base), 0o400); err != nil {
		_ = os.Remove(a.basePath(base))
		return nil, err
	}
	next := nextVolumeDisk(r.Disk)
	nextPath := filepath.Join(dir, next)
	_ = os.Remove(nextPath) // a leftover of a snapshot that failed before it recorded it
	if err := vd.CreateVolumeDisk(ctx, nextPath, r.SizeMiB, VolumeFrom{Backing: baseRef(base)}); err != nil {
		_ = os.Remove(a.basePath(base))
		return nil, fmt.Errorf("its new overlay: %w", err)
	}
	if err := os.Chmod(nextPath, 0o600); err != nil {
		_ = os.Remove(nextPath)
		_ = os.Remove(a.basePath(base))
		return nil, err
	}
	moved := *r
	moved.Disk, moved.Bases = next, append([]string{base}, r.Bases...)
	if err := a.saveVolume(dir, &moved); err != nil {
		_ = os.Remove(nextPath)
		_ = os.Remove(a.basePath(base))
		return nil, err
	}
	held[i].set(&moved)
	return &volumeFreeze{e: held[i], before: r, moved: &moved, base: base, att: att}, nil
}

// switches are the driver's part of the freezes.
func (sv *snapshotVolumes) switches(a *Agent) []VolumeSwitch {
	var out []VolumeSwitch
	for _, f := range sv.freezes {
		mv := MachineVolume{ID: f.att.ID, Serial: agentapi.VolumeSerial(f.att.ID), Slot: f.att.Slot,
			Path: filepath.Join(a.volDir(f.att.ID), f.before.Disk), SizeMiB: f.before.SizeMiB}
		for _, b := range f.before.Bases {
			mv.Backing = append(mv.Backing, a.basePath(b))
		}
		out = append(out, VolumeSwitch{Volume: mv, Next: filepath.Join(a.volDir(f.att.ID), f.moved.Disk)})
	}
	return out
}

// finish ends the freezes once the driver is done: a volume it moved
// (switched) drops the old name of its frozen file; any other is recorded
// back onto its file. It returns the snapshot's volumes, in the VM's
// order, and releases the volumes' locks.
func (sv *snapshotVolumes) finish(a *Agent, r vmRecord, switched []string) []snapshotVolume {
	defer sv.held.unlock()
	var out []snapshotVolume
	for _, att := range r.Volumes {
		if att.ReadOnly {
			size := int64(0)
			if _, vr, err := a.volumeRecordOf(att.ID); err == nil {
				size = vr.SizeMiB
			}
			out = append(out, snapshotVolume{ID: att.ID, SizeMiB: size, ReadOnly: true, Slot: att.Slot})
		}
		for _, f := range sv.freezes {
			if f.att.ID != att.ID {
				continue
			}
			if !slices.Contains(switched, att.ID) {
				a.unfreeze(f)
				continue
			}
			if err := os.Remove(filepath.Join(a.volDir(att.ID), f.before.Disk)); err != nil {
				a.log.Warn("remove the old name of a frozen volume disk", "volume", att.ID, "file", f.before.Disk, "err", err)
			}
			out = append(out, snapshotVolume{ID: att.ID, SizeMiB: f.moved.SizeMiB, Slot: att.Slot, Frozen: true,
				Bases: slices.Clone(f.moved.Bases)})
		}
	}
	return out
}

// undo takes back every freeze (step 1 only: the driver moved nothing).
func (sv *snapshotVolumes) undo(a *Agent) {
	for _, f := range sv.freezes {
		a.unfreeze(f)
	}
	sv.freezes = nil
}

// unfreeze records volume f back onto the file the VM writes. Should that
// fail, the record names the empty overlay on that file, which reads the
// same: nothing is lost, the chain is one longer.
func (a *Agent) unfreeze(f *volumeFreeze) {
	dir := a.volDir(f.att.ID)
	if err := a.saveVolume(dir, f.before); err != nil {
		a.log.Error("record a volume back onto its disk after a failed snapshot", "volume", f.att.ID, "err", err)
		return
	}
	f.e.set(f.before)
	_ = os.Remove(filepath.Join(dir, f.moved.Disk))
	if err := os.Chmod(filepath.Join(dir, f.before.Disk), 0o600); err != nil {
		a.log.Warn("make a volume disk writable again", "volume", f.att.ID, "err", err)
	}
	// Its base goes with the next collectBases: nothing names it.
}

// snapshotBases adds the bases that snapshots name to used; false when a
// snapshot cannot be read (its chains are unknown: keep every base).
func (a *Agent) snapshotBases(used map[string]bool) bool {
	for _, s := range a.snaps.all() {
		rec, corrupt, gone := s.state()
		switch {
		case gone:
		case corrupt != "":
			return false
		case rec != nil:
			for _, v := range rec.Volumes {
				for _, b := range v.Bases {
					used[b] = true
				}
			}
		}
	}
	return true
}

// snapshotVolumeOf returns volume vol of snapshot id, locked against the
// snapshot's delete while the caller holds the returned unlock.
func (a *Agent) snapshotVolumeOf(ctx context.Context, id, vol string) (snapshotVolume, func(), error) {
	if err := checkSnapshotID(id); err != nil {
		return snapshotVolume{}, nil, err
	}
	s, err := a.snaps.acquire(ctx, id)
	if err != nil {
		return snapshotVolume{}, nil, err
	}
	if s == nil {
		return snapshotVolume{}, nil, errSnapshotNotFound(id)
	}
	rec, corrupt, _ := s.state()
	switch {
	case corrupt != "":
		s.unlock()
		return snapshotVolume{}, nil, errConflict("snapshot %s exists but %s", id, corrupt)
	case rec == nil:
		s.unlock()
		return snapshotVolume{}, nil, errSnapshotNotFound(id)
	}
	i := slices.IndexFunc(rec.Volumes, func(v snapshotVolume) bool { return v.ID == vol })
	if i < 0 {
		s.unlock()
		e := errInvalid("snapshot %s has no volume %s; it has %v", id, vol, snapshotVolumeIDs(rec.Volumes))
		e.Details = map[string]any{"snapshot": id, "volume": vol}
		return snapshotVolume{}, nil, e
	}
	v := rec.Volumes[i]
	if !v.Frozen {
		s.unlock()
		return snapshotVolume{}, nil, errInvalid("volume %s was attached read-only to the vm of snapshot %s: the snapshot has no frozen point of it (its children share the volume itself)", vol, id)
	}
	if len(v.Bases) == 0 {
		s.unlock()
		return snapshotVolume{}, nil, errConflict("snapshot %s was pulled from agent %s: the frozen point of volume %s is there; pull the volume from that agent (source.peer)", id, rec.Origin, vol)
	}
	return v, s.unlock, nil
}

func snapshotVolumeIDs(vs []snapshotVolume) []string {
	out := []string{}
	for _, v := range vs {
		out = append(out, v.ID)
	}
	return out
}

// cloneSnapshotVolume makes r (in partial) an overlay of the frozen point
// its source names (a snapshot's volume on this agent).
func (a *Agent) cloneSnapshotVolume(ctx context.Context, vd Volumer, r *volumeRecord, partial string) error {
	src := r.Source
	v, unlock, err := a.snapshotVolumeOf(ctx, src.Snapshot, src.Volume)
	if err != nil {
		return err
	}
	defer unlock()
	if r.SizeMiB < v.SizeMiB {
		e := errInvalid("size_mib %d is smaller than the %d MiB of volume %s in snapshot %s: a clone is at least as large as its source",
			r.SizeMiB, v.SizeMiB, src.Volume, src.Snapshot)
		e.Details = map[string]any{"size_mib": r.SizeMiB, "source_size_mib": v.SizeMiB}
		return e
	}
	a.basesMu.Lock()
	defer a.basesMu.Unlock()
	for _, b := range v.Bases {
		if _, err := os.Stat(a.basePath(b)); err != nil {
			return errConflict("snapshot %s: the frozen point of volume %s is damaged (%v); take another snapshot", src.Snapshot, src.Volume, err)
		}
	}
	if err := vd.CreateVolumeDisk(ctx, filepath.Join(partial, r.Disk), r.SizeMiB, VolumeFrom{Backing: baseRef(v.Bases[0])}); err != nil {
		return fmt.Errorf("clone volume %s of snapshot %s: %w", src.Volume, src.Snapshot, err)
	}
	r.Bases = slices.Clone(v.Bases)
	return nil
}

// getSnapshotVolumeContent is GET /v1/snapshots/{id}/volumes/{volume}/content:
// the frozen point of a volume as one qcow2, with its sha256 in a header
// (as GET /v1/volumes/{id}/content), for a fork child on another agent.
func (a *Agent) getSnapshotVolumeContent(c echo.Context) error {
	ctx := c.Request().Context()
	id, vol := c.Param("id"), c.Param("volume")
	ex, ok := a.cfg.Driver.(VolumeExporter)
	if !ok {
		return errConflict("the %s driver of this agent cannot export volumes", a.cfg.Driver.Name())
	}
	v, unlock, err := a.snapshotVolumeOf(ctx, id, vol)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp(a.volsDir(), exportPrefix+vol+"-")
	if err != nil {
		unlock()
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	mv := MachineVolume{ID: vol, Serial: agentapi.VolumeSerial(vol), ReadOnly: true, Path: a.basePath(v.Bases[0]), SizeMiB: v.SizeMiB}
	for _, b := range v.Bases[1:] {
		mv.Backing = append(mv.Backing, a.basePath(b))
	}
	dst := filepath.Join(dir, volumeDiskFile)
	err = ex.ExportVolumeDisk(ctx, mv, dst)
	unlock() // the export is a copy of files that never change
	if err != nil {
		return fmt.Errorf("export volume %s of snapshot %s: %w", vol, id, err)
	}
	f, err := os.Open(dst)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return fmt.Errorf("digest the export of volume %s of snapshot %s: %w", vol, id, err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	hd := c.Response().Header()
	hd.Set(HeaderVolumeSHA256, hex.EncodeToString(h.Sum(nil)))
	hd.Set(HeaderVolumeSizeMiB, strconv.FormatInt(v.SizeMiB, 10))
	hd.Set(echo.HeaderContentType, "application/octet-stream")
	hd.Set(echo.HeaderContentLength, strconv.FormatInt(n, 10))
	c.Response().WriteHeader(http.StatusOK)
	if _, err := io.Copy(c.Response(), f); err != nil {
		a.log.Warn("send snapshot volume content", "snapshot", id, "volume", vol, "err", err)
	}
	return nil
}

// checkChildVolumes checks the volumes of a VM started from snapshot id
// against the snapshot's: one for each, in its order, read-only exactly
// where the source's was; a read-only one is the source's volume itself
// (shared), a read-write one a volume made from the snapshot's frozen
// point of it (here or pulled). It returns the attachments, in the
// snapshot's slots.
func (a *Agent) checkChildVolumes(id string, snap []snapshotVolume, want []agentapi.VolumeAttachment) ([]vmVolume, error) {
	if len(want) != len(snap) {
		return nil, errInvalid("snapshot %s is of a vm with %d volumes: a vm started from it needs one for each (%v), in that order, got %d",
			id, len(snap), snapshotVolumeIDs(snap), len(want))
	}
	out := make([]vmVolume, len(want))
	for i, sv := range snap {
		w := want[i]
		if w.ReadOnly != sv.ReadOnly {
			return nil, errInvalid("snapshot %s: volumes[%d] of its vm (%s) is read_only %t: the child's volumes[%d] must be too", id, i, sv.ID, sv.ReadOnly, i)
		}
		if sv.ReadOnly {
			if w.ID != sv.ID {
				return nil, errInvalid("snapshot %s: volumes[%d] of its vm is volume %s, read-only: its children share it, so the child's volumes[%d] is %s, not %s",
					id, i, sv.ID, i, sv.ID, w.ID)
			}
		} else {
			_, r, err := a.volumeRecordOf(w.ID)
			if err != nil {
				return nil, errVolumeUnknown(w.ID)
			}
			if r.Source == nil || r.Source.Snapshot != id || r.Source.Volume != sv.ID {
				return nil, errInvalid("volume %s was not made from volume %s of snapshot %s (source %s): a child's read-write volume is a clone of its source's frozen point (PUT /v1/volumes/%s with source {snapshot, volume})",
					w.ID, sv.ID, id, describeSource(r.Source), w.ID)
			}
			if r.SizeMiB != sv.SizeMiB {
				return nil, errInvalid("volume %s has %d MiB, volume %s of snapshot %s %d MiB: a child continues a guest that saw that size", w.ID, r.SizeMiB, sv.ID, id, sv.SizeMiB)
			}
		}
		out[i] = vmVolume{ID: w.ID, ReadOnly: w.ReadOnly, Slot: sv.Slot}
	}
	return out, nil
}

// claimChildVolumes checks the volumes of VM vm, started from snapshot
// id (checkChildVolumes), and claims them as claimVolumes does; the
// attachments are in the snapshot's slots. The caller records them in the
// VM's entry before it unlocks them.
func (a *Agent) claimChildVolumes(ctx context.Context, vm, id string, snap []snapshotVolume, want []agentapi.VolumeAttachment) (volumeLocks, []vmVolume, error) {
	atts, err := a.checkChildVolumes(id, snap, want)
	if err != nil {
		return nil, nil, err
	}
	held, vols, err := a.claimVolumes(ctx, vm, want)
	if err != nil {
		return nil, nil, err
	}
	for i := range vols {
		vols[i].Slot = atts[i].Slot
	}
	return held, vols, nil
}

// errNoFreeze is what a driver without SnapshotOptions.Volumes support
// would leave: a snapshot that did not move a read-write volume.
var errNoFreeze = errors.New("the driver did not freeze every read-write volume")
