package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// Attachment states (volume_attachments.state): how far a hot attach or
// detach got. A row in attaching or detaching names the replica that runs
// the step; the host monitor settles a row whose replica is gone against
// the agent's view of the VM.
const (
	// AttachmentAttached: the agent has the volume on the VM.
	AttachmentAttached = "attached"
	// AttachmentAttaching: the volume is claimed for the VM (rw_vm or
	// readers) and the agent may or may not have it yet.
	AttachmentAttaching = "attaching"
	// AttachmentDetaching: the agent is asked to detach it; the row and
	// its claim go once the agent confirmed.
	AttachmentDetaching = "detaching"
)

// Errors of hot attach and detach.
var (
	// ErrAttachmentBusy: another attach or detach of the same volume and
	// VM has not finished (or was left by a stopped replica and waits for
	// the host monitor).
	ErrAttachmentBusy = errors.New("an attach or detach of this volume and vm is in progress")
	// ErrTooManyVolumes: the VM has the most volumes a VM can have.
	ErrTooManyVolumes = errors.New("vm has the most volumes a vm can have")
	// ErrVMNotAttachable: the VM is being created or is gone.
	ErrVMNotAttachable = errors.New("vm cannot take a volume now")
)

// AttachmentStep is an attachment row with the step it is in.
type AttachmentStep struct {
	VolumeID  string     `gorm:"column:volume_id"`
	VMID      string     `gorm:"column:vm_id"`
	ReadOnly  bool       `gorm:"column:read_only"`
	State     string     `gorm:"column:state"`
	Owner     *string    `gorm:"column:owner_replica"`
	CreatedAt time.Time  `gorm:"column:created_at"`
	UpdatedAt *time.Time `gorm:"column:updated_at"`
}

// Since is when the row's step began.
func (a AttachmentStep) Since() time.Time {
	if a.UpdatedAt != nil {
		return *a.UpdatedAt
	}
	return a.CreatedAt
}

// BeginAttach claims volume volID for VM vmID in one transaction: the VM's
// row first (so two attaches to one VM count its volumes one after the
// other), then the volume's by the conditional UPDATE of a VM create's
// attach (read-write only while no VM has it, read-only while no VM has
// it read-write, only while it is ready on the VM's host), then the
// attachment row in state attaching, owned by owner.
//
// The same attachment there already (attached, same mode) is returned
// with done set and nothing changes. Errors: ErrNotFound (the VM or the
// volume is gone), ErrVMNotAttachable, ErrTooManyVolumes (max volumes
// per VM), ErrAttachmentBusy (a step of this pair is in flight, or the
// volume is attached to the VM in the other mode: a *AttachmentModeError),
// ErrVolumeNotReady, *VolumeAttachedError.
func (s *Store) BeginAttach(ctx context.Context, vmID, volID string, readOnly bool, owner string, maxPerVM int) (done bool, err error) {
	err = s.inTx(ctx, func(tx *gorm.DB) error {
		vm, err := s.lockVM(tx, vmID)
		if err != nil {
			return err
		}
		switch vm.ObservedState {
		case "creating", "missing", "lost", "error":
			return fmt.Errorf("vm %s is %s: %w", vmID, vm.ObservedState, ErrVMNotAttachable)
		}
		if err := refuseWhileMigrating(tx, vmID, "the attach of volume "+volID); err != nil {
			return err
		}
		var rows []AttachmentStep
		if err := tx.Table("volume_attachments").Where("vm_id = ?", vmID).Find(&rows).Error; err != nil {
			return fmt.Errorf("read volumes of vm %s: %w", vmID, err)
		}
		for _, r := range rows {
			if r.VolumeID != volID {
				continue
			}
			switch {
			case r.State != AttachmentAttached:
				return fmt.Errorf("volume %s on vm %s is %s: %w", volID, vmID, r.State, ErrAttachmentBusy)
			case r.ReadOnly != readOnly:
				return &AttachmentModeError{Volume: volID, VM: vmID, ReadOnly: r.ReadOnly}
			}
			done = true
			return nil
		}
		if len(rows) >= maxPerVM {
			return fmt.Errorf("vm %s has %d volumes: %w", vmID, len(rows), ErrTooManyVolumes)
		}
		if err := s.attachVolumes(tx, VM{ID: vmID, HostName: vm.HostName, Volumes: []VMVolume{{VolumeID: volID, ReadOnly: readOnly}}}); err != nil {
			return err
		}
		t := now()
		return tx.Exec(`INSERT INTO volume_attachments (volume_id, vm_id, read_only, created_at, state, owner_replica, updated_at)
			VALUES (?, ?, ?, ?, ?, ?, ?)`, volID, vmID, readOnly, t, AttachmentAttaching, owner, t).Error
	})
	return done, err
}

// AttachmentModeError is ErrAttachmentBusy of a volume that is attached
// to the VM already, in the other mode.
type AttachmentModeError struct {
	Volume, VM string
	ReadOnly   bool
}

func (e *AttachmentModeError) Error() string {
	return fmt.Sprintf("volume %s is attached to vm %s with read_only %t", e.Volume, e.VM, e.ReadOnly)
}

// Unwrap makes errors.Is(err, ErrAttachmentBusy) hold.
func (e *AttachmentModeError) Unwrap() error { return ErrAttachmentBusy }

// FinishAttach marks an attaching row attached once the agent has the
// volume. A row attached already (settled by a host monitor meanwhile)
// is no error; ErrNotFound when the row is gone or detaching (undone by
// a host monitor, or its VM deleted): the agent must not keep it.
func (s *Store) FinishAttach(ctx context.Context, vmID, volID string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volume_attachments SET state = ?, owner_replica = NULL, updated_at = ?
		WHERE volume_id = ? AND vm_id = ? AND state = ?`, AttachmentAttached, now(), volID, vmID, AttachmentAttaching)
	if res.Error != nil {
		return fmt.Errorf("record attach of volume %s to vm %s: %w", volID, vmID, res.Error)
	}
	if res.RowsAffected == 1 {
		return nil
	}
	var n int64
	if err := s.db.WithContext(ctx).Raw(`SELECT COUNT(*) FROM volume_attachments WHERE volume_id = ? AND vm_id = ? AND state = ?`,
		volID, vmID, AttachmentAttached).Scan(&n).Error; err != nil {
		return fmt.Errorf("read attach of volume %s to vm %s: %w", volID, vmID, err)
	}
	if n == 1 {
		return nil
	}
	return fmt.Errorf("attaching volume %s on vm %s: %w", volID, vmID, ErrNotFound)
}

// BeginDetach marks the attachment of volume volID to VM vmID detaching,
// owned by owner, and returns it. A row detaching already is taken over
// (a detach is idempotent on the agent). ErrNotFound when the volume is
// not attached to the VM; ErrAttachmentBusy while it is being attached.
func (s *Store) BeginDetach(ctx context.Context, vmID, volID, owner string) (AttachmentStep, error) {
	var row AttachmentStep
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		if _, err := s.lockVM(tx, vmID); err != nil {
			return err
		}
		if err := refuseWhileMigrating(tx, vmID, "the detach of volume "+volID); err != nil {
			return err
		}
		err := tx.Table("volume_attachments").Where("volume_id = ? AND vm_id = ?", volID, vmID).Take(&row).Error
		if errors.Is(err, gorm.ErrRecordNotFound) {
			return fmt.Errorf("volume %s on vm %s: %w", volID, vmID, ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("read volume %s of vm %s: %w", volID, vmID, err)
		}
		if row.State == AttachmentAttaching {
			return fmt.Errorf("volume %s on vm %s is attaching: %w", volID, vmID, ErrAttachmentBusy)
		}
		t := now()
		row.State, row.Owner, row.UpdatedAt = AttachmentDetaching, &owner, &t
		return tx.Exec(`UPDATE volume_attachments SET state = ?, owner_replica = ?, updated_at = ? WHERE volume_id = ? AND vm_id = ?`,
			AttachmentDetaching, owner, t, volID, vmID).Error
	})
	return row, err
}

// EndAttachment removes the attachment row of volume volID and VM vmID
// if it is in state (a finished detach, or an undone attach) and gives
// the volume's claim back (rw_vm, or one reader), in one transaction:
// the row's delete decides, so the claim goes back exactly once. It
// reports whether it removed the row.
func (s *Store) EndAttachment(ctx context.Context, vmID, volID, state string) (bool, error) {
	removed := false
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var rows []AttachmentStep
		if err := tx.Table("volume_attachments").Where("volume_id = ? AND vm_id = ? AND state = ?", volID, vmID, state).
			Find(&rows).Error; err != nil {
			return fmt.Errorf("read volume %s of vm %s: %w", volID, vmID, err)
		}
		if len(rows) == 0 {
			return nil
		}
		// The volume's row before any other: the lock order of volumes.
		if _, err := s.lockVolume(tx, volID); err != nil {
			return err
		}
		res := tx.Exec(`DELETE FROM volume_attachments WHERE volume_id = ? AND vm_id = ? AND state = ?`, volID, vmID, state)
		if res.Error != nil {
			return fmt.Errorf("detach volume %s from vm %s: %w", volID, vmID, res.Error)
		}
		if res.RowsAffected == 0 {
			return nil
		}
		q := `UPDATE volumes SET rw_vm = NULL, updated_at = ? WHERE id = ? AND rw_vm = ?`
		args := []any{now(), volID, vmID}
		if rows[0].ReadOnly {
			q = `UPDATE volumes SET readers = readers - 1, updated_at = ? WHERE id = ? AND readers > 0`
			args = args[:2]
		}
		if err := tx.Exec(q, args...).Error; err != nil {
			return fmt.Errorf("give back volume %s from vm %s: %w", volID, vmID, err)
		}
		removed = true
		return nil
	})
	return removed, err
}

// UnsettledAttachments returns the attaching and detaching rows of the
// VMs on host.
func (s *Store) UnsettledAttachments(ctx context.Context, host string) ([]AttachmentStep, error) {
	var rows []AttachmentStep
	err := s.db.WithContext(ctx).Table("volume_attachments").
		Where("state <> ? AND vm_id IN (SELECT id FROM vms WHERE host_name = ?)", AttachmentAttached, host).
		Order("vm_id, volume_id").Find(&rows).Error
	if err != nil {
		return nil, fmt.Errorf("read unsettled attachments on host %s: %w", host, err)
	}
	return rows, nil
}

// AttachmentStepsOfVM returns every attachment row of VM vmID with its state.
func (s *Store) AttachmentStepsOfVM(ctx context.Context, vmID string) ([]AttachmentStep, error) {
	var rows []AttachmentStep
	err := s.db.WithContext(ctx).Table("volume_attachments").Where("vm_id = ?", vmID).Order("created_at, volume_id").Find(&rows).Error
	if err != nil {
		return nil, fmt.Errorf("read volumes of vm %s: %w", vmID, err)
	}
	return rows, nil
}

// SetAttachmentOwner makes owner the owner of the attachment row of
// volume volID and VM vmID while it is in state.
func (s *Store) SetAttachmentOwner(ctx context.Context, vmID, volID, state, owner string) error {
	err := s.db.WithContext(ctx).Exec(`UPDATE volume_attachments SET owner_replica = ? WHERE volume_id = ? AND vm_id = ? AND state = ?`,
		owner, volID, vmID, state).Error
	if err != nil {
		return fmt.Errorf("hand over volume %s of vm %s: %w", volID, vmID, err)
	}
	return nil
}

// TakeOverAttachment makes owner the owner of an unsettled attachment
// row if it still is in state with the owner the caller read (nil: none);
// false when another replica took it first or it was settled.
func (s *Store) TakeOverAttachment(ctx context.Context, r AttachmentStep, owner string) (bool, error) {
	q := `UPDATE volume_attachments SET owner_replica = ? WHERE volume_id = ? AND vm_id = ? AND state = ? AND owner_replica = ?`
	args := []any{owner, r.VolumeID, r.VMID, r.State}
	if r.Owner == nil {
		q = `UPDATE volume_attachments SET owner_replica = ? WHERE volume_id = ? AND vm_id = ? AND state = ? AND owner_replica IS NULL`
	} else {
		args = append(args, *r.Owner)
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take over volume %s of vm %s: %w", r.VolumeID, r.VMID, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// RestoreAttached turns a detaching row that owner still owns back to
// attached: the agent refused the detach and still has the volume.
func (s *Store) RestoreAttached(ctx context.Context, vmID, volID, owner string) error {
	err := s.db.WithContext(ctx).Exec(`UPDATE volume_attachments SET state = ?, owner_replica = NULL, updated_at = ?
		WHERE volume_id = ? AND vm_id = ? AND state = ? AND owner_replica = ?`,
		AttachmentAttached, now(), volID, vmID, AttachmentDetaching, owner).Error
	if err != nil {
		return fmt.Errorf("record volume %s attached to vm %s again: %w", volID, vmID, err)
	}
	return nil
}
