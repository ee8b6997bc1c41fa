package store

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"
)

// tombstoneVolume records, in the transaction that deletes volume row v,
// that it was deleted on purpose (deleted_volumes).
func tombstoneVolume(tx *gorm.DB, v Volume) error {
	err := tx.Exec(`INSERT INTO deleted_volumes (volume_id, host_name, deleted_at) VALUES (?, ?, ?)
		ON CONFLICT (volume_id) DO NOTHING`, v.ID, v.HostName, now()).Error
	if err != nil {
		return fmt.Errorf("record the delete of volume %s: %w", v.ID, err)
	}
	return nil
}

// VolumeWasDeleted reports whether a volume row with this id was deleted
// on purpose (its tombstone is there).
func (s *Store) VolumeWasDeleted(ctx context.Context, id string) (bool, error) {
	var n int64
	if err := s.db.WithContext(ctx).Raw("SELECT COUNT(*) FROM deleted_volumes WHERE volume_id = ?", id).Scan(&n).Error; err != nil {
		return false, fmt.Errorf("look up the delete of volume %s: %w", id, err)
	}
	return n > 0, nil
}

// MarkVolumeLost turns a ready volume of host into state error with
// reason (its agent no longer has it). The capacity stays held: the
// host's disk may hold the file again once restored, and the owner's
// delete releases it. ErrNotFound when no ready volume with this id is
// on host (changed meanwhile).
func (s *Store) MarkVolumeLost(ctx context.Context, id, host, reason string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET state = ?, reason = ?, updated_at = ?
		WHERE id = ? AND host_name = ? AND state = ?`, VolumeError, reason, now(), id, host, VolumeReady)
	if res.Error != nil {
		return fmt.Errorf("mark volume %s lost: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("ready volume %s on host %s: %w", id, host, ErrNotFound)
	}
	return nil
}

// ErrVolumesOnHost: a host still has volumes (a retire is refused).
var ErrVolumesOnHost = errors.New("host has volumes")

// VolumesOnHostError is ErrVolumesOnHost with the volumes, by id.
type VolumesOnHostError struct {
	Host    string
	Volumes []Volume
}

func (e *VolumesOnHostError) Error() string {
	return fmt.Sprintf("host %s has %d volumes", e.Host, len(e.Volumes))
}

// Unwrap makes errors.Is(err, ErrVolumesOnHost) hold.
func (e *VolumesOnHostError) Unwrap() error { return ErrVolumesOnHost }

// volumesBlockRetire is a *VolumesOnHostError when host has volumes that
// are not being deleted.
func volumesBlockRetire(tx *gorm.DB, host string) error {
	var vols []Volume
	if err := tx.Where("host_name = ? AND state <> ?", host, VolumeDeleting).Order("id").Find(&vols).Error; err != nil {
		return fmt.Errorf("retire host %s: read its volumes: %w", host, err)
	}
	if len(vols) == 0 {
		return nil
	}
	return &VolumesOnHostError{Host: host, Volumes: vols}
}

// MarkVolumeFound turns volume id of host, in state error with exactly
// reason (MarkVolumeLost's), back to ready: its agent has it again (its
// state directory was restored). ErrNotFound when the row is not in that
// state any more.
func (s *Store) MarkVolumeFound(ctx context.Context, id, host, reason string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE volumes SET state = ?, reason = '', updated_at = ?
		WHERE id = ? AND host_name = ? AND state = ? AND reason = ? AND holds_capacity`, VolumeReady, now(), id, host, VolumeError, reason)
	if res.Error != nil {
		return fmt.Errorf("mark volume %s found: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("lost volume %s on host %s: %w", id, host, ErrNotFound)
	}
	return nil
}
