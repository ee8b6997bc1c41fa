package agent

// Volumes (issue 26): qcow2 disks that outlive the VMs they are attached
// to, stored by id (volumes are mutable, so not content-addressed).
//
//	<state>/volumes/<id>/volume.json   the volume's metadata (volumeRecord)
//	<state>/volumes/<id>/disk.qcow2    the file the volume writes; a clone
//	                                   moves it to disk.N.qcow2 (below)
//	<state>/volumes/.bases/<name>      frozen files that clones share
//
// A copy-on-write clone freezes the source's current file into a base
// (a hard link into .bases, made read-only: no data is copied) and puts
// both the source and the clone on overlays of their own on it, so that
// writes to either never show in the other. A base has no owner: it is
// kept while some volume's chain (volumeRecord.Bases) names it, so the
// source can be deleted before its clones and the other way round; an
// agent that starts removes the bases no volume names (the refcount is
// the set of records, never a counter that a crash could leave wrong).
//
// A new volume is made in a <state>/volumes/.partial-* directory, its
// metadata written last, and renamed into place whole: a volume directory
// either is complete or does not exist, and start-up removes what a crash
// left of the rest (and any disk file of a volume that its record does not
// name, from a clone that did not finish).
//
// Attachments are part of the VM's record (vmRecord.Volumes), so they
// survive an agent restart with the VM; a volume's attached_to is found
// from the VMs' records. Locks are taken VM first, then volume.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/limits"
)

const (
	volumeMetaFile = "volume.json"
	volumeVersion  = 1
	volumeDiskFile = "disk.qcow2"
	basesDirName   = ".bases"
	// MaxVolumesPerVM bounds the volumes of one VM: the qemu driver gives
	// each a hot-plug slot of its own at boot.
	MaxVolumesPerVM = 8
	// CodeVolumeAttached is the code of a 409 for a volume that is in use
	// by a VM (a delete, or a read-write attach to a second VM).
	CodeVolumeAttached = "volume_attached"
)

// Volumer is a Driver that can make volume disks and attach them to VMs.
// The agent owns the volume directories, their metadata and the chains of
// frozen bases; the driver makes and changes the files it is given.
type Volumer interface {
	// CreateVolumeDisk makes a new volume disk of sizeMiB at path (a file
	// that does not exist yet): empty, the disk content of an image, or an
	// overlay on a frozen base (VolumeFrom).
	CreateVolumeDisk(ctx context.Context, path string, sizeMiB int64, from VolumeFrom) error
	// ResizeVolumeDisk grows a volume disk that no VM has open.
	ResizeVolumeDisk(ctx context.Context, path string, sizeMiB int64) error
	// AttachVolume adds v to m's running VMM (hot-plug), DetachVolume
	// removes it and returns once the VMM has closed its files. Both are
	// idempotent: a volume already there (or already gone) is no error.
	AttachVolume(ctx context.Context, m *Machine, v MachineVolume) error
	DetachVolume(ctx context.Context, m *Machine, v MachineVolume) error
	// ResizeAttachedVolume grows v while m's VMM has it open; the guest
	// sees the new size.
	ResizeAttachedVolume(ctx context.Context, m *Machine, v MachineVolume, sizeMiB int64) error
}

// VolumeFrom is what CreateVolumeDisk starts from: Image, the disk of an
// image (copied, not shared: the volume outlives the image), or Backing,
// a frozen base the new disk is an overlay of. Neither: an empty disk.
type VolumeFrom struct {
	Image   string
	Backing string // the base's path relative to the new disk's directory
}

// MachineVolume is one volume attached to a Machine.
type MachineVolume struct {
	ID       string
	Serial   string // agentapi.VolumeSerial(ID)
	ReadOnly bool
	// Slot is the volume's hot-plug slot in the VM (0 to MaxVolumesPerVM-1),
	// fixed while it is attached.
	Slot int
	// Path is the file the volume writes; Backing its frozen bases, top
	// first (absolute paths).
	Path    string
	Backing []string
	SizeMiB int64
}

// vmVolume is one attachment in a VM's record.
type vmVolume struct {
	ID       string `json:"id"`
	ReadOnly bool   `json:"read_only,omitempty"`
	Slot     int    `json:"slot"`
}

// volumeRecord is the durable metadata of one volume,
// <state>/volumes/<id>/volume.json.
type volumeRecord struct {
	Version int                    `json:"version"`
	ID      string                 `json:"id"`
	SizeMiB int64                  `json:"size_mib"`
	Source  *agentapi.VolumeSource `json:"source,omitempty"`
	// Disk is the file in the volume's directory that it writes to.
	Disk string `json:"disk"`
	// Bases are the frozen files below Disk, top first, by name in
	// <state>/volumes/.bases.
	Bases     []string  `json:"bases,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

func (r *volumeRecord) validate(id string) error {
	switch {
	case r.Version != volumeVersion:
		return fmt.Errorf("version %d, want %d", r.Version, volumeVersion)
	case r.ID != id:
		return fmt.Errorf("id %q does not match its directory %q", r.ID, id)
	case r.SizeMiB < 1:
		return fmt.Errorf("size_mib %d", r.SizeMiB)
	case !fileNamePattern.MatchString(r.Disk) || r.Disk == volumeMetaFile:
		return fmt.Errorf("disk %q is not a plain file name", r.Disk)
	}
	for _, b := range r.Bases {
		if !fileNamePattern.MatchString(b) {
			return fmt.Errorf("base %q is not a plain file name", b)
		}
	}
	return nil
}

func (a *Agent) volsDir() string             { return filepath.Join(a.cfg.StateDir, "volumes") }
func (a *Agent) volDir(id string) string     { return filepath.Join(a.volsDir(), id) }
func (a *Agent) basesDir() string            { return filepath.Join(a.volsDir(), basesDirName) }
func (a *Agent) basePath(name string) string { return filepath.Join(a.basesDir(), name) }

// baseRef is how a volume's overlay names a base: relative to the volume's
// directory (or a .partial-* directory beside it), so the state directory
// can move.
func baseRef(name string) string { return filepath.Join("..", basesDirName, name) }

// ErrVolumeConflict is what a Volumer returns for a volume operation the VM
// cannot take in its state (a 409 with the message).
func ErrVolumeConflict(format string, args ...any) error { return errConflict(format, args...) }

func checkVolumeID(id string) *Error {
	if !idPattern.MatchString(id) {
		return errInvalid("volume id %q is not valid: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit", id)
	}
	return nil
}

func errVolumeNotFound(id string) *Error {
	return &Error{Status: http.StatusNotFound, Code: CodeNotFound,
		Message: fmt.Sprintf("volume %s does not exist on this agent", id), Details: map[string]any{"id": id}}
}

func (a *Agent) volumer() (Volumer, error) {
	v, ok := a.cfg.Driver.(Volumer)
	if !ok {
		return nil, errConflict("the %s driver of this agent has no volumes", a.cfg.Driver.Name())
	}
	return v, nil
}

func (a *Agent) saveVolume(dir string, r *volumeRecord) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, volumeMetaFile), b, !a.cfg.NoSync); err != nil {
		return fmt.Errorf("write metadata of volume %s: %w", r.ID, err)
	}
	return nil
}

// machineVolume is attachment v of a VM as its driver sees it; false when
// the volume is gone (it cannot be while attached, but a corrupt record
// must not stop the VM's other work).
func (a *Agent) machineVolume(v vmVolume) (MachineVolume, bool) {
	e := a.vols.lookup(v.ID)
	if e == nil {
		return MachineVolume{}, false
	}
	r, corrupt, gone := e.state()
	if gone || corrupt != "" || r == nil {
		return MachineVolume{}, false
	}
	mv := MachineVolume{ID: v.ID, Serial: agentapi.VolumeSerial(v.ID), ReadOnly: v.ReadOnly, Slot: v.Slot,
		Path: filepath.Join(a.volDir(v.ID), r.Disk), SizeMiB: r.SizeMiB}
	for _, b := range r.Bases {
		mv.Backing = append(mv.Backing, a.basePath(b))
	}
	return mv, true
}

// volumeUse is one VM that has a volume attached.
type volumeUse struct {
	VM       string
	ReadOnly bool
	State    string
}

// volumeUsers lists the VMs that have volume id attached, by VM id.
func (a *Agent) volumeUsers(id string) []volumeUse {
	var out []volumeUse
	for _, e := range a.vms.all() {
		r, _, gone := e.state()
		if gone {
			continue
		}
		for _, v := range r.Volumes {
			if v.ID == id {
				out = append(out, volumeUse{VM: e.id, ReadOnly: v.ReadOnly, State: r.State})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].VM < out[j].VM })
	return out
}

func errVolumeAttached(id string, u volumeUse, what string) *Error {
	mode := "read-write"
	if u.ReadOnly {
		mode = "read-only"
	}
	return &Error{Status: http.StatusConflict, Code: CodeVolumeAttached,
		Message: fmt.Sprintf("volume %s is attached %s to vm %s: %s", id, mode, u.VM, what),
		Details: map[string]any{"id": id, "vm": u.VM, "read_only": u.ReadOnly}}
}

func (a *Agent) volumeWire(r *volumeRecord) agentapi.Volume {
	v := agentapi.Volume{ID: r.ID, SizeMiB: r.SizeMiB, Serial: agentapi.VolumeSerial(r.ID), State: agentapi.VolumeReady, CreatedAt: r.CreatedAt}
	if r.Source != nil {
		s := *r.Source
		v.Source = &s
	}
	if users := a.volumeUsers(r.ID); len(users) > 0 {
		v.AttachedTo, v.ReadOnly = users[0].VM, users[0].ReadOnly
		for _, u := range users {
			if !u.ReadOnly {
				v.AttachedTo, v.ReadOnly = u.VM, false
			}
		}
	}
	if fi, err := os.Stat(filepath.Join(a.volDir(r.ID), r.Disk)); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			v.AllocatedBytes = st.Blocks * 512
		}
	}
	return v
}

// loadVolumes registers the volumes in the state directory and removes
// what a crash left: unfinished creates and deletes, disk files of a clone
// that did not finish, and bases no volume names any more.
func (a *Agent) loadVolumes() error {
	if err := os.MkdirAll(a.basesDir(), 0o700); err != nil {
		return fmt.Errorf("create volume directory %s: %w", a.basesDir(), err)
	}
	entries, err := os.ReadDir(a.volsDir())
	if err != nil {
		return fmt.Errorf("read volume directory %s: %w", a.volsDir(), err)
	}
	for _, de := range entries {
		name := de.Name()
		dir := filepath.Join(a.volsDir(), name)
		if !de.IsDir() || name == basesDirName {
			continue
		}
		if strings.HasPrefix(name, ".") {
			a.log.Warn("remove an unfinished volume create or delete", "dir", dir)
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove volume leftovers", "dir", dir, "err", err)
			}
			continue
		}
		e := a.vols.entry(name)
		b, err := os.ReadFile(filepath.Join(dir, volumeMetaFile))
		var rec volumeRecord
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err == nil {
			err = rec.validate(name)
		}
		if err != nil {
			reason := fmt.Sprintf("metadata %s cannot be used (%v); delete the volume", filepath.Join(dir, volumeMetaFile), err)
			e.setCorrupt(nil, reason)
			a.log.Error("corrupt volume metadata", "volume", name, "reason", reason)
			continue
		}
		a.tidyVolumeDir(dir, &rec)
		e.set(&rec)
	}
	a.collectBases()
	return nil
}

// tidyVolumeDir removes the files of a volume's directory that its record
// does not name (a clone that stopped half way made them), and makes its
// disk writable again (such a clone may have frozen it before it recorded
// the move to a new file).
func (a *Agent) tidyVolumeDir(dir string, r *volumeRecord) {
	files, _ := os.ReadDir(dir)
	for _, f := range files {
		if f.Name() == volumeMetaFile || f.Name() == r.Disk {
			continue
		}
		a.log.Warn("remove a volume file its metadata does not name", "volume", r.ID, "file", f.Name())
		_ = os.Remove(filepath.Join(dir, f.Name()))
	}
	if err := os.Chmod(filepath.Join(dir, r.Disk), 0o600); err != nil {
		a.log.Error("volume disk", "volume", r.ID, "err", err)
	}
}

// collectBases removes the bases that no volume names. The caller holds
// no volume lock; basesMu keeps a clone from making a base meanwhile.
func (a *Agent) collectBases() {
	a.basesMu.Lock()
	defer a.basesMu.Unlock()
	used := map[string]bool{}
	for _, e := range a.vols.all() {
		if r, corrupt, gone := e.state(); !gone && r != nil {
			for _, b := range r.Bases {
				used[b] = true
			}
		} else if corrupt != "" {
			return // its chain is unknown: keep every base
		}
	}
	if !a.snapshotBases(used) { // the frozen points of snapshots (volume_fork.go)
		return
	}
	files, _ := os.ReadDir(a.basesDir())
	for _, f := range files {
		if used[f.Name()] {
			continue
		}
		if err := os.Remove(a.basePath(f.Name())); err != nil {
			a.log.Warn("remove an unused volume base", "base", f.Name(), "err", err)
			continue
		}
		a.log.Info("volume base removed: no volume uses it", "base", f.Name())
	}
}

// volumeLocks holds the operation locks of some volumes.
type volumeLocks []*entry[*volumeRecord]

func (l volumeLocks) unlock() {
	for _, e := range l {
		e.unlock()
	}
}

// lockVolumes takes the locks of the volumes ids (sorted, so two calls
// never wait for each other) and returns their records; a volume that does
// not exist is a 400 naming it.
func (a *Agent) lockVolumes(ctx context.Context, ids []string) (volumeLocks, []*volumeRecord, error) {
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	var held volumeLocks
	recs := map[string]*volumeRecord{}
	for _, id := range slices.Compact(sorted) {
		e, err := a.vols.acquire(ctx, id)
		if err != nil {
			held.unlock()
			return nil, nil, err
		}
		if e == nil {
			held.unlock()
			return nil, nil, errVolumeUnknown(id)
		}
		held = append(held, e)
		r, corrupt, _ := e.state()
		if corrupt != "" {
			held.unlock()
			return nil, nil, errConflict("volume %s cannot be attached: %s", id, corrupt)
		}
		if r == nil {
			held.unlock()
			return nil, nil, errVolumeUnknown(id)
		}
		recs[id] = r
	}
	out := make([]*volumeRecord, len(ids))
	for i, id := range ids {
		out[i] = recs[id]
	}
	return held, out, nil
}

func errVolumeUnknown(id string) *Error {
	e := errInvalid("volume %s does not exist on this agent: create it here first (PUT /v1/volumes/%s)", id, id)
	e.Details = map[string]any{"volume": id}
	return e
}

// checkVolumeAttachments validates the volumes of a VM create (or one hot
// attach): known ids, no id twice, at most MaxVolumesPerVM.
func checkVolumeAttachments(vols []agentapi.VolumeAttachment) error {
	if len(vols) > MaxVolumesPerVM {
		return errInvalid("a vm can have at most %d volumes, got %d", MaxVolumesPerVM, len(vols))
	}
	seen := map[string]bool{}
	for _, v := range vols {
		if err := checkVolumeID(v.ID); err != nil {
			return err
		}
		if seen[v.ID] {
			return errInvalid("volume %s is listed twice", v.ID)
		}
		seen[v.ID] = true
	}
	return nil
}

// checkVolumeFree refuses an attachment of volume id to vm that would let
// two VMs see it while one writes: read-write needs the volume to itself,
// read-only needs no writer.
func (a *Agent) checkVolumeFree(id, vm string, readOnly bool) error {
	for _, u := range a.volumeUsers(id) {
		if u.VM == vm {
			continue
		}
		if !readOnly || !u.ReadOnly {
			return errVolumeAttached(id, u, "detach it there first (a volume is attached read-write to one vm, or read-only to any number)")
		}
	}
	return nil
}

func checkVolumeSize(size int64) error {
	if size < 1 || size > limits.MaxDiskMiB {
		return errInvalid("size_mib must be between 1 and %d, got %d", limits.MaxDiskMiB, size)
	}
	return nil
}
