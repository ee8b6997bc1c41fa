package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// Volume states (volumes.state).
const (
	// VolumeCreating: reserved; the agent may or may not have it yet.
	VolumeCreating = "creating"
	VolumeReady    = "ready"
	// VolumeDeleting: the agent is asked to delete it; the row and its
	// capacity go once the agent confirmed.
	VolumeDeleting = "deleting"
	VolumeError    = "error"
	// VolumeMoving: the volume moves to another host (volume_move.go); it
	// holds its size on two hosts until the move ends.
	VolumeMoving = "moving"
)

// Errors of volumes.
var (
	// ErrVolumeAttached: the volume is attached (read-write to another VM,
	// or at all for a delete or a read-write attach). The error names the VM.
	ErrVolumeAttached = errors.New("volume is attached")
	// ErrVolumeNotReady: the volume is not ready (being created or deleted,
	// or failed) or not on the host the caller asked for.
	ErrVolumeNotReady = errors.New("volume is not ready on that host")
)

// Volume is a row of volumes.
type Volume struct {
	ID            string            `gorm:"column:id;primaryKey"`
	Project       string            `gorm:"column:project"`
	Name          string            `gorm:"column:name"`
	HostName      string            `gorm:"column:host_name"`
	SizeMiB       int64             `gorm:"column:size_mib"`
	SourceImage   string            `gorm:"column:source_image"`
	SourceVolume  string            `gorm:"column:source_volume"`
	Labels        map[string]string `gorm:"column:labels;serializer:json"`
	State         string            `gorm:"column:state"`
	Reason        string            `gorm:"column:reason"`
	HoldsCapacity bool              `gorm:"column:holds_capacity"`
	// RWVM is the VM that has the volume read-write (nil: none); Readers
	// counts its read-only attachments.
	RWVM    *string `gorm:"column:rw_vm"`
	Readers int64   `gorm:"column:readers"`
	// Placement is the placement explanation as JSON ("" when pinned).
	Placement string `gorm:"column:placement"`
	// Owner is the control replica that runs the volume's create or delete.
	Owner *string `gorm:"column:owner_replica"`
	// MoveTarget, MoveSource and MoveDigest describe a move
	// (volume_move.go): the other host the row holds its size on.
	MoveTarget *string   `gorm:"column:move_target"`
	MoveSource *string   `gorm:"column:move_source"`
	MoveDigest string    `gorm:"column:move_digest"`
	CreatedAt  time.Time `gorm:"column:created_at"`
	UpdatedAt  time.Time `gorm:"column:updated_at"`

	// SourceSnapshot: a fork child's volume, made from the frozen point
	// of SourceVolume in this snapshot (the fork's id).
	SourceSnapshot string `gorm:"column:source_snapshot"`
}

// TableName is the table of Volume.
func (Volume) TableName() string { return "volumes" }

// VolumeAttachment is a row of volume_attachments.
type VolumeAttachment struct {
	VolumeID  string    `gorm:"column:volume_id;primaryKey"`
	VMID      string    `gorm:"column:vm_id;primaryKey"`
	ReadOnly  bool      `gorm:"column:read_only"`
	CreatedAt time.Time `gorm:"column:created_at"`
	// State is how far a hot attach or detach got (volume_attach.go);
	// the database's default, attached, for the rows of a VM's create.
	State string `gorm:"column:state;default:attached"`
}

// TableName is the table of VolumeAttachment.
func (VolumeAttachment) TableName() string { return "volume_attachments" }

// volumeShare is what a volume of size MiB holds of its project: disk only.
func volumeShare(sizeMiB int64) share { return share{Resources: Resources{DiskMiB: sizeMiB}} }

// ReserveAndInsertVolume is the volume's reservation: in one transaction
// the conditional UPDATE of a VM's reservation (reserveOnHostSQL, with no
// vCPUs and no memory) adds the size to its host's disk allocation only if
// it fits, the project's usage grows under its disk_mib quota, and the row
// is inserted (state creating, holding capacity). ErrNoRoom when the host
// cannot take it (or is not alive and schedulable), a *QuotaError past
// the quota, ErrDuplicateName when the project has a volume of that name,
// ErrNotFound when the host is not registered.
func (s *Store) ReserveAndInsertVolume(ctx context.Context, v Volume) error {
	t := now()
	v.CreatedAt, v.UpdatedAt, v.HoldsCapacity = t, t, true
	if v.Project == "" {
		v.Project = DefaultProject
	}
	if v.Labels == nil {
		v.Labels = map[string]string{}
	}
	if v.State == "" {
		v.State = VolumeCreating
	}
	err := s.reserveVolume(ctx, v, false)
	if s.dialect == DialectPostgres && isQuota(err) {
		// The project's row refused it, maybe only for what the quota
		// leases of the reservation committers hold: take them back first.
		err = s.reserveVolume(ctx, v, true)
	}
	switch {
	case err == nil || errors.Is(err, ErrNoRoom) || isQuota(err):
		return err
	case isDuplicate(err):
		return fmt.Errorf("volume name %q: %w", v.Name, ErrDuplicateName)
	case isForeignKey(err):
		return fmt.Errorf("host %s: %w", v.HostName, ErrNotFound)
	}
	return fmt.Errorf("reserve volume %s on host %s: %w", v.ID, v.HostName, err)
}

// reserveVolume runs the reservation; with reclaim it first takes every
// quota lease of the project back to it (the lock order of every writer:
// leases, host, project).
func (s *Store) reserveVolume(ctx context.Context, v Volume, reclaim bool) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		if reclaim {
			if err := reclaimLeases(tx, v.Project, nil); err != nil {
				return err
			}
		}
		if err := reserveHostDisk(tx, v.HostName, v.SizeMiB); err != nil {
			return err
		}
		if err := s.chargeProject(tx, v.Project, volumeShare(v.SizeMiB)); err != nil {
			return err
		}
		return tx.Create(&v).Error
	})
}

// reserveHostDisk adds sizeMiB to host's disk allocation with the
// reservation's conditional UPDATE; ErrNoRoom when it does not fit.
func reserveHostDisk(tx *gorm.DB, host string, sizeMiB int64) error {
	res := tx.Exec(reserveOnHostSQL, 0, 0, sizeMiB, host, 0, 0, sizeMiB)
	if res.Error != nil {
		return fmt.Errorf("reserve %d MiB of disk on host %s: %w", sizeMiB, host, res.Error)
	}
	if res.RowsAffected != 1 {
		return fmt.Errorf("host %s: %d MiB of disk: %w", host, sizeMiB, ErrNoRoom)
	}
	return nil
}

// SetVolumeState records a volume's state and reason (e.g. ready once the
// agent made it). ErrNotFound when the row is gone.
func (s *Store) SetVolumeState(ctx context.Context, id, state, reason string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET state = ?, reason = ?, updated_at = ? WHERE id = ?`,
		state, reason, now(), id)
	if res.Error != nil {
		return fmt.Errorf("record state of volume %s: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("volume %s: %w", id, ErrNotFound)
	}
	return nil
}

// MarkVolumeReady turns a creating volume ready; ErrNotFound when there is
// no creating volume with this id (deleted meanwhile, or settled already).
func (s *Store) MarkVolumeReady(ctx context.Context, id string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET state = ?, reason = '', owner_replica = NULL, updated_at = ?
		WHERE id = ? AND state = ?`, VolumeReady, now(), id, VolumeCreating)
	if res.Error != nil {
		return fmt.Errorf("mark volume %s ready: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("creating volume %s: %w", id, ErrNotFound)
	}
	return nil
}

// BeginDeleteVolume marks a volume deleting, owned by owner, unless it is
// attached (ErrVolumeAttached, naming a VM). A volume being deleted
// already is returned as it is (the delete is retried).
func (s *Store) BeginDeleteVolume(ctx context.Context, id, owner string) (Volume, error) {
	var v Volume
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if v, err = s.lockVolume(tx, id); err != nil {
			return err
		}
		if v.RWVM != nil || v.Readers > 0 {
			return attachedError(tx, v)
		}
		if v.State == VolumeMoving || v.MoveTarget != nil || v.MoveSource != nil {
			return fmt.Errorf("volume %s is moving (it is on two hosts until the move ends): %w", id, ErrVolumeNotReady)
		}
		v.State, v.Owner = VolumeDeleting, &owner
		return tx.Exec(`UPDATE volumes SET state = ?, owner_replica = ?, updated_at = ? WHERE id = ?`,
			VolumeDeleting, owner, now(), id).Error
	})
	return v, err
}

// attachedError is ErrVolumeAttached naming one VM that has v.
func attachedError(tx *gorm.DB, v Volume) error {
	vm := ""
	if v.RWVM != nil {
		vm = *v.RWVM
	} else {
		_ = tx.Raw(`SELECT vm_id FROM volume_attachments WHERE volume_id = ? ORDER BY vm_id LIMIT 1`, v.ID).Scan(&vm).Error
	}
	return &VolumeAttachedError{Volume: v.ID, VM: vm, ReadOnly: v.RWVM == nil}
}

// VolumeAttachedError is ErrVolumeAttached with the VM that has the volume.
type VolumeAttachedError struct {
	Volume   string
	VM       string
	ReadOnly bool
}

func (e *VolumeAttachedError) Error() string {
	mode := "read-write"
	if e.ReadOnly {
		mode = "read-only"
	}
	return fmt.Sprintf("volume %s is attached %s to vm %s", e.Volume, mode, e.VM)
}

// Unwrap makes errors.Is(err, ErrVolumeAttached) hold.
func (e *VolumeAttachedError) Unwrap() error { return ErrVolumeAttached }

// DeleteVolume releases the volume's capacity (if it still holds it) and
// removes the row in one transaction; it reports whether capacity was
// released. Call it once the agent confirmed the volume is gone. A volume
// attached meanwhile is ErrVolumeAttached (nothing changes).
func (s *Store) DeleteVolume(ctx context.Context, id string) (Volume, bool, error) {
	var (
		v        Volume
		released bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if v, err = s.lockVolume(tx, id); err != nil {
			return err
		}
		if v.RWVM != nil || v.Readers > 0 {
			return attachedError(tx, v)
		}
		if released, err = releaseVolumeInTx(tx, v); err != nil {
			return err
		}
		if err := tombstoneVolume(tx, v); err != nil {
			return err
		}
		return tx.Exec("DELETE FROM volumes WHERE id = ?", id).Error
	})
	return v, released, err
}

// releaseVolumeInTx gives the volume's size back to its host and project
// if it still holds it: the conditional UPDATE on holds_capacity makes it
// happen once. The volume's row first, then the host, then the project:
// the lock order of every writer of volumes.
func releaseVolumeInTx(tx *gorm.DB, v Volume) (bool, error) {
	res := tx.Exec(`UPDATE volumes SET holds_capacity = FALSE, updated_at = ? WHERE id = ? AND holds_capacity`, now(), v.ID)
	if res.Error != nil {
		return false, fmt.Errorf("release volume %s: %w", v.ID, res.Error)
	}
	if res.RowsAffected == 0 {
		return false, nil
	}
	if err := tx.Exec(`UPDATE hosts SET alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, v.SizeMiB, v.HostName).Error; err != nil {
		return false, fmt.Errorf("release volume %s on host %s: %w", v.ID, v.HostName, err)
	}
	if err := creditProject(tx, v.Project, volumeShare(v.SizeMiB)); err != nil {
		return false, fmt.Errorf("release volume %s: %w", v.ID, err)
	}
	return true, nil
}

// GrowVolume reserves the growth of volume id from one size to another
// and records the new size in one transaction: the row changes only if it
// still has the size the caller read, the host's conditional UPDATE adds
// the growth only if it fits, and the project's usage grows under its
// quota. ErrNoRoom when it does not fit, ErrNotFound when the volume is
// gone, not ready or its size changed meanwhile.
func (s *Store) GrowVolume(ctx context.Context, id string, from, to int64) error {
	err := s.growVolume(ctx, id, from, to, false)
	if s.dialect == DialectPostgres && isQuota(err) {
		err = s.growVolume(ctx, id, from, to, true)
	}
	return err
}

func (s *Store) growVolume(ctx context.Context, id string, from, to int64, reclaim bool) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		v, err := s.lockVolume(tx, id)
		if err != nil {
			return err
		}
		if v.RWVM != nil {
			// The copy a migration makes of the volume has the size it
			// had when the migration began.
			if err := refuseWhileMigrating(tx, *v.RWVM, "the growth of volume "+id); err != nil {
				return err
			}
		}
		if reclaim {
			if err := reclaimLeases(tx, v.Project, nil); err != nil {
				return err
			}
		}
		res := tx.Exec(`UPDATE volumes SET size_mib = ?, updated_at = ? WHERE id = ? AND size_mib = ? AND holds_capacity AND state = ?`,
			to, now(), id, from, VolumeReady)
		if res.Error != nil {
			return fmt.Errorf("record size of volume %s: %w", id, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("ready volume %s of %d MiB: %w", id, from, ErrNotFound)
		}
		if err := reserveHostDisk(tx, v.HostName, to-from); err != nil {
			return err
		}
		return s.chargeProject(tx, v.Project, volumeShare(to-from))
	})
}

// UndoGrowVolume takes back a GrowVolume whose agent call failed.
func (s *Store) UndoGrowVolume(ctx context.Context, id string, from, to int64) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		v, err := s.lockVolume(tx, id)
		if errors.Is(err, ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		res := tx.Exec(`UPDATE volumes SET size_mib = ?, updated_at = ? WHERE id = ? AND size_mib = ? AND holds_capacity`,
			from, now(), id, to)
		if res.Error != nil {
			return res.Error
		}
		if res.RowsAffected == 0 {
			return nil // released or changed meanwhile: nothing of ours to undo
		}
		if err := tx.Exec(`UPDATE hosts SET alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, to-from, v.HostName).Error; err != nil {
			return err
		}
		return creditProject(tx, v.Project, volumeShare(to-from))
	})
}

// lockVolume reads volume id in tx and, on PostgreSQL, locks its row
// until tx ends, like lockVM.
func (s *Store) lockVolume(tx *gorm.DB, id string) (Volume, error) {
	q := tx.Where("id = ?", id)
	if s.dialect == DialectPostgres {
		q = q.Clauses(clause.Locking{Strength: "UPDATE"})
	}
	return takeVolume(q, "volume "+id)
}

func takeVolume(q *gorm.DB, what string) (Volume, error) {
	var v Volume
	err := q.Take(&v).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Volume{}, fmt.Errorf("%s: %w", what, ErrNotFound)
	}
	if err != nil {
		return Volume{}, fmt.Errorf("read %s: %w", what, err)
	}
	return v, nil
}

// GetVolume returns one volume; ErrNotFound when there is none.
func (s *Store) GetVolume(ctx context.Context, id string) (Volume, error) {
	return takeVolume(s.db.WithContext(ctx).Where("id = ?", id), "volume "+id)
}

// GetVolumeByName returns the volume of project with this name.
func (s *Store) GetVolumeByName(ctx context.Context, project, name string) (Volume, error) {
	return takeVolume(s.db.WithContext(ctx).Where("project = ? AND name = ?", project, name), fmt.Sprintf("volume named %q", name))
}

// VolumeFilter selects volumes in a list; empty fields match everything.
type VolumeFilter struct {
	Project string
	Host    string
	// States, when set, are the states listed.
	States []string
	// After is the last id of the previous page.
	After string
	Limit int
}

// ListVolumes returns the volumes matching f, ordered by id.
func (s *Store) ListVolumes(ctx context.Context, f VolumeFilter) ([]Volume, error) {
	q := keysetPage(s.db.WithContext(ctx), "id", f.After, f.Limit)
	if f.Project != "" {
		q = q.Where("project = ?", f.Project)
	}
	if f.Host != "" {
		q = q.Where("host_name = ?", f.Host)
	}
	if len(f.States) > 0 {
		q = q.Where("state IN ?", f.States)
	}
	var out []Volume
	if err := q.Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list volumes: %w", err)
	}
	return out, nil
}

// SetVolumeLabels replaces a volume's labels.
func (s *Store) SetVolumeLabels(ctx context.Context, id string, labels map[string]string) error {
	if labels == nil {
		labels = map[string]string{}
	}
	text, err := jsonText(labels)
	if err != nil {
		return err
	}
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET labels = ?, updated_at = ? WHERE id = ?`, text, now(), id)
	if res.Error != nil {
		return fmt.Errorf("update labels of volume %s: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("volume %s: %w", id, ErrNotFound)
	}
	return nil
}

// VolumeAttachments returns the attachments of the volumes ids, by volume.
func (s *Store) VolumeAttachments(ctx context.Context, ids []string) (map[string][]VolumeAttachment, error) {
	return s.attachmentsBy(ctx, "volume_id", "volume_id, vm_id", ids, func(a VolumeAttachment) string { return a.VolumeID })
}

// AttachmentsOfVMs returns the volumes attached to each of the VMs ids.
func (s *Store) AttachmentsOfVMs(ctx context.Context, ids []string) (map[string][]VolumeAttachment, error) {
	return s.attachmentsBy(ctx, "vm_id", "vm_id, created_at, volume_id", ids, func(a VolumeAttachment) string { return a.VMID })
}

// attachmentsBy reads the attachments whose column (volume_id or vm_id)
// is one of ids, in order, grouped by key.
func (s *Store) attachmentsBy(ctx context.Context, column, order string, ids []string, key func(VolumeAttachment) string) (map[string][]VolumeAttachment, error) {
	out := map[string][]VolumeAttachment{}
	if len(ids) == 0 {
		return out, nil
	}
	var rows []VolumeAttachment
	if err := s.db.WithContext(ctx).Where(column+" IN ?", ids).Order(order).Find(&rows).Error; err != nil {
		return nil, fmt.Errorf("read volume attachments: %w", err)
	}
	for _, a := range rows {
		out[key(a)] = append(out[key(a)], a)
	}
	return out, nil
}

// attachVolumes attaches vm's volumes in tx, each by a conditional UPDATE
// of its row: read-write only while no VM has it, read-only while no VM
// has it read-write; and only while it is ready on vm's host. The rows are
// taken in id order, so two creates that share volumes never deadlock.
func (s *Store) attachVolumes(tx *gorm.DB, vm VM) error {
	atts := slices.Clone(vm.Volumes)
	slices.SortFunc(atts, func(a, b VMVolume) int {
		if a.VolumeID < b.VolumeID {
			return -1
		}
		if a.VolumeID > b.VolumeID {
			return 1
		}
		return 0
	})
	t := now()
	for _, a := range atts {
		var res *gorm.DB
		if a.ReadOnly {
			res = tx.Exec(`UPDATE volumes SET readers = readers + 1, updated_at = ?
				WHERE id = ? AND host_name = ? AND state = ? AND rw_vm IS NULL`, t, a.VolumeID, vm.HostName, VolumeReady)
		} else {
			res = tx.Exec(`UPDATE volumes SET rw_vm = ?, updated_at = ?
				WHERE id = ? AND host_name = ? AND state = ? AND rw_vm IS NULL AND readers = 0`, vm.ID, t, a.VolumeID, vm.HostName, VolumeReady)
		}
		if res.Error != nil {
			return fmt.Errorf("attach volume %s to vm %s: %w", a.VolumeID, vm.ID, res.Error)
		}
		if res.RowsAffected == 1 {
			continue
		}
		v, err := takeVolume(tx.Where("id = ?", a.VolumeID), "volume "+a.VolumeID)
		if err != nil {
			return err
		}
		if v.State != VolumeReady || v.HostName != vm.HostName {
			return fmt.Errorf("volume %s is %s on host %s, not ready on host %s: %w", v.ID, v.State, v.HostName, vm.HostName, ErrVolumeNotReady)
		}
		return attachedError(tx, v)
	}
	return nil
}

// volumesAttachable tells why vm's volumes cannot be attached now
// (ErrVolumeNotReady, or a *VolumeAttachedError), or nil when they can: it
// tells a refused reservation statement's causes apart.
func (s *Store) volumesAttachable(ctx context.Context, vm VM) error {
	db := s.db.WithContext(ctx)
	for _, a := range vm.Volumes {
		v, err := takeVolume(db.Where("id = ?", a.VolumeID), "volume "+a.VolumeID)
		if err != nil {
			return err
		}
		switch {
		case v.State != VolumeReady || v.HostName != vm.HostName:
			return fmt.Errorf("volume %s is %s on host %s, not ready on host %s: %w", v.ID, v.State, v.HostName, vm.HostName, ErrVolumeNotReady)
		case v.RWVM != nil || (!a.ReadOnly && v.Readers > 0):
			return attachedError(db, v)
		}
	}
	return nil
}

// detachVolumesInTx detaches every volume of VM vmID in tx (a VM's delete).
func detachVolumesInTx(tx *gorm.DB, vmID string) error {
	var atts []VolumeAttachment
	if err := tx.Where("vm_id = ?", vmID).Order("volume_id").Find(&atts).Error; err != nil {
		return fmt.Errorf("read volumes of vm %s: %w", vmID, err)
	}
	t := now()
	for _, a := range atts {
		q := `UPDATE volumes SET rw_vm = NULL, updated_at = ? WHERE id = ? AND rw_vm = ?`
		args := []any{t, a.VolumeID, vmID}
		if a.ReadOnly {
			q = `UPDATE volumes SET readers = readers - 1, updated_at = ? WHERE id = ? AND readers > 0`
			args = args[:2]
		}
		if err := tx.Exec(q, args...).Error; err != nil {
			return fmt.Errorf("detach volume %s from vm %s: %w", a.VolumeID, vmID, err)
		}
	}
	if err := tx.Exec("DELETE FROM volume_attachments WHERE vm_id = ?", vmID).Error; err != nil {
		return fmt.Errorf("detach volumes of vm %s: %w", vmID, err)
	}
	return nil
}

// reserveVMWithVolumes is the reservation on SQLite of a VM that names
// volumes (PostgreSQL has them in its reservation statement), in one
// transaction: the volumes are attached first (their rows, in id
// order), then the VM's host reservation, the project's usage, the group
// slot and the VM's rows, as in a batch of one.
func (s *Store) reserveVMWithVolumes(ctx context.Context, vm VM) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		if err := s.attachVolumes(tx, vm); err != nil {
			return err
		}
		r := vm.Resources
		res := tx.Exec(reserveOnHostSQL, r.VCPUs, r.MemoryMiB, r.DiskMiB, vm.HostName, r.VCPUs, r.MemoryMiB, r.DiskMiB)
		if res.Error != nil {
			return res.Error
		}
		if res.RowsAffected != 1 {
			return fmt.Errorf("host %s: %w", vm.HostName, ErrNoRoom)
		}
		if vm.ProjectGeneration != 0 {
			var n int64
			if err := tx.Raw(`SELECT COUNT(*) FROM projects WHERE name = ? AND generation = ?`, vm.Project, vm.ProjectGeneration).
				Scan(&n).Error; err != nil {
				return fmt.Errorf("read project %q: %w", vm.Project, err)
			}
			if n == 0 {
				return fmt.Errorf("project %q (generation %d): %w", vm.Project, vm.ProjectGeneration, ErrProjectChanged)
			}
		}
		if err := s.chargeProject(tx, vm.Project, vmShare(vm)); err != nil {
			return err
		}
		if err := takeGroupSlot(tx, vm); err != nil {
			return err
		}
		args, err := vmRowArgs(vm)
		if err != nil {
			return err
		}
		if err := tx.Exec(insertVMSQL, args...).Error; err != nil {
			return err
		}
		if err := insertLabels(tx, vm.ID, vm.Labels); err != nil {
			return err
		}
		if err := insertNICRows(func(args ...any) error { return tx.Exec(insertNICSQL, args...).Error }, vm.ID, vm.NICs); err != nil {
			return err
		}
		return s.recordVolumeAttachments(tx, vm)
	})
}

// recordVolumeAttachments writes vm's volume_attachments rows. They are
// apart from attachVolumes because they need the VM's row first (their
// foreign key), while the volumes' rows are taken before the host's.
func (s *Store) recordVolumeAttachments(tx *gorm.DB, vm VM) error {
	t := now()
	for _, a := range vm.Volumes {
		if err := tx.Create(&VolumeAttachment{VolumeID: a.VolumeID, VMID: vm.ID, ReadOnly: a.ReadOnly, CreatedAt: t}).Error; err != nil {
			return fmt.Errorf("record attachment of volume %s to vm %s: %w", a.VolumeID, vm.ID, err)
		}
	}
	return nil
}

// VMVolume is a volume a VM is created with.
type VMVolume struct {
	VolumeID string
	ReadOnly bool
	// State is the attachment's (volume_attach.go) when read back.
	State string
}
