package store

// Moves of detached volumes to another host (migration 0021). A moving
// row holds its size on two hosts, never on its project twice:
//
//	BeginMoveVolume    ready -> moving, move_target reserved on the target
//	RecordMoveDigest   the sha256 the target's pull checks
//	SwitchVolumeHost   host_name becomes the target, move_source the old host
//	FinishVolumeMove   the old host's copy is gone: its share is released, ready
//	UndoVolumeMove     the target's copy is gone: its share is released, ready
//
// Each step is one transaction that locks the volume's row first, then
// the hosts' rows (the lock order of every writer of volumes), and each
// checks the phase it expects, so a step that a dead replica's successor
// already took is a no-op (ErrNotFound), never a second release.

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"
)

// ErrMovePhase: the volume is not in the phase of a move the step expects
// (another replica or the host monitor took the step already).
var ErrMovePhase = errors.New("volume is not in that phase of a move")

// BeginMoveVolume starts moving ready, detached volume id to host target
// in one transaction: the target's disk allocation grows by the volume's
// size with the reservation's conditional UPDATE (ErrNoRoom when it does
// not fit, or the host is not alive and schedulable), and the row turns
// moving with the target and owner recorded. The project is charged
// nothing: it is the same volume. A volume that is not ready is
// ErrVolumeNotReady; an attached one a *VolumeAttachedError.
func (s *Store) BeginMoveVolume(ctx context.Context, id, target, owner string) (Volume, error) {
	var v Volume
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if v, err = s.lockVolume(tx, id); err != nil {
			return err
		}
		switch {
		case v.RWVM != nil || v.Readers > 0:
			return attachedError(tx, v)
		case v.State != VolumeReady || !v.HoldsCapacity || v.MoveTarget != nil || v.MoveSource != nil:
			return fmt.Errorf("volume %s is %s on host %s: %w", id, v.State, v.HostName, ErrVolumeNotReady)
		case v.HostName == target:
			return fmt.Errorf("volume %s is on host %s already: %w", id, target, ErrMovePhase)
		}
		if err := reserveHostDisk(tx, target, v.SizeMiB); err != nil {
			return err
		}
		t := now()
		if err := tx.Exec(`UPDATE volumes SET state = ?, move_target = ?, move_digest = '', reason = '', owner_replica = ?, updated_at = ?
			WHERE id = ?`, VolumeMoving, target, owner, t, id).Error; err != nil {
			return fmt.Errorf("mark volume %s moving to host %s: %w", id, target, err)
		}
		v.State, v.MoveTarget, v.MoveDigest, v.Owner, v.UpdatedAt = VolumeMoving, &target, "", &owner, t
		return nil
	})
	return v, err
}

// RecordMoveDigest records the sha256 of the source's export of a volume
// moving to target; ErrMovePhase when it is not moving there any more.
func (s *Store) RecordMoveDigest(ctx context.Context, id, target, digest string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET move_digest = ?, updated_at = ?
		WHERE id = ? AND state = ? AND move_target = ?`, digest, now(), id, VolumeMoving, target)
	if res.Error != nil {
		return fmt.Errorf("record the digest of volume %s: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("volume %s moving to host %s: %w", id, target, ErrMovePhase)
	}
	return nil
}

// SwitchVolumeHost makes target the host of a volume moving there, whose
// copy the target's agent has complete: host_name becomes target and
// move_source the old host, whose share stays held until its copy is
// deleted (FinishVolumeMove). No allocation changes here. reason tells
// GET why the volume is still moving.
func (s *Store) SwitchVolumeHost(ctx context.Context, id, target, reason string) (Volume, error) {
	var v Volume
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if v, err = s.lockVolume(tx, id); err != nil {
			return err
		}
		if v.State != VolumeMoving || v.MoveTarget == nil || *v.MoveTarget != target {
			return fmt.Errorf("volume %s (%s on host %s) is not moving to host %s: %w", id, v.State, v.HostName, target, ErrMovePhase)
		}
		source := v.HostName
		t := now()
		if err := tx.Exec(`UPDATE volumes SET host_name = ?, move_target = NULL, move_source = ?, reason = ?, updated_at = ? WHERE id = ?`,
			target, source, reason, t, id).Error; err != nil {
			return fmt.Errorf("switch volume %s to host %s: %w", id, target, err)
		}
		v.HostName, v.MoveTarget, v.MoveSource, v.Reason, v.UpdatedAt = target, nil, &source, reason, t
		return nil
	})
	return v, err
}

// FinishVolumeMove ends a move whose old copy on host source is deleted
// (or whose source host is retired): the source's share of the volume is
// released and the row is ready again (a row that turned error meanwhile,
// its new host retired, stays error). ErrMovePhase when source holds
// nothing of it any more.
func (s *Store) FinishVolumeMove(ctx context.Context, id, source string) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		v, err := s.lockVolume(tx, id)
		if err != nil {
			return err
		}
		if v.MoveSource == nil || *v.MoveSource != source {
			return fmt.Errorf("volume %s holds nothing on host %s: %w", id, source, ErrMovePhase)
		}
		if err := releaseMoveShare(tx, v, source); err != nil {
			return err
		}
		return endMove(tx, v, "move_source")
	})
}

// UndoVolumeMove ends a move whose copy on host target is deleted (or
// never made, or whose target is retired) before the switch: the
// target's reservation is released and the row is ready on its host again
// (a row that turned error meanwhile stays error). ErrMovePhase when
// target holds nothing of it any more.
func (s *Store) UndoVolumeMove(ctx context.Context, id, target string) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		v, err := s.lockVolume(tx, id)
		if err != nil {
			return err
		}
		if v.MoveTarget == nil || *v.MoveTarget != target {
			return fmt.Errorf("volume %s holds nothing on host %s: %w", id, target, ErrMovePhase)
		}
		if err := releaseMoveShare(tx, v, target); err != nil {
			return err
		}
		return endMove(tx, v, "move_target")
	})
}

// releaseMoveShare gives the volume's size back to host, unless the host
// is retired (a retire sets its allocation to zero: it holds nothing).
func releaseMoveShare(tx *gorm.DB, v Volume, host string) error {
	if err := tx.Exec(`UPDATE hosts SET alloc_disk_mib = alloc_disk_mib - ? WHERE name = ? AND retired_at IS NULL`,
		v.SizeMiB, host).Error; err != nil {
		return fmt.Errorf("release volume %s on host %s: %w", v.ID, host, err)
	}
	return nil
}

// endMove clears column (move_target or move_source) and the move's
// digest, owner and reason; a moving row turns ready.
func endMove(tx *gorm.DB, v Volume, column string) error {
	state := v.State
	if state == VolumeMoving {
		state = VolumeReady
	}
	reason := v.Reason
	if v.State == VolumeMoving {
		reason = ""
	}
	err := tx.Exec(`UPDATE volumes SET `+column+` = NULL, move_digest = '', owner_replica = NULL, state = ?, reason = ?, updated_at = ?
		WHERE id = ?`, state, reason, now(), v.ID).Error
	if err != nil {
		return fmt.Errorf("end the move of volume %s: %w", v.ID, err)
	}
	return nil
}

// TakeVolumeMove makes owner the replica that settles volume id's move,
// if its owner is still from (nil: none); it reports whether it did. Two
// replicas that both saw the owner's lease lapse take turns this way.
func (s *Store) TakeVolumeMove(ctx context.Context, id string, from *string, owner string) (bool, error) {
	q := `UPDATE volumes SET owner_replica = ?, updated_at = ? WHERE id = ? AND owner_replica = ?`
	args := []any{owner, now(), id, from}
	if from == nil {
		q = `UPDATE volumes SET owner_replica = ?, updated_at = ? WHERE id = ? AND owner_replica IS NULL`
		args = args[:3]
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take the move of volume %s: %w", id, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// VolumeMovesOn returns the volumes whose move involves host: moving from
// or to it, or with a share on it that a move left.
func (s *Store) VolumeMovesOn(ctx context.Context, host string) ([]Volume, error) {
	var out []Volume
	err := s.db.WithContext(ctx).
		Where("move_target = ? OR move_source = ? OR (host_name = ? AND state = ?)", host, host, host, VolumeMoving).
		Order("id").Find(&out).Error
	if err != nil {
		return nil, fmt.Errorf("read the volume moves of host %s: %w", host, err)
	}
	return out, nil
}

// RevertVolumeSwitch takes back the switch of a volume whose new host
// turned out not to have its copy (it was lost after the switch, before
// the old copy on source was deleted): the row names source again and
// the new host becomes the move's target, so that the move is undone
// like one that failed before its switch (UndoVolumeMove). Both hosts
// keep their shares meanwhile. ErrMovePhase when source holds nothing of
// it any more.
func (s *Store) RevertVolumeSwitch(ctx context.Context, id, source string) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		v, err := s.lockVolume(tx, id)
		if err != nil {
			return err
		}
		if v.State != VolumeMoving || v.MoveSource == nil || *v.MoveSource != source {
			return fmt.Errorf("volume %s (%s on host %s) was not switched from host %s: %w", id, v.State, v.HostName, source, ErrMovePhase)
		}
		return tx.Exec(`UPDATE volumes SET host_name = ?, move_source = NULL, move_target = ?, move_digest = '', reason = '', updated_at = ?
			WHERE id = ?`, source, v.HostName, now(), id).Error
	})
}
