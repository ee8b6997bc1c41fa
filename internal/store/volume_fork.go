package store

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"
)

// AttachForkVolume attaches volume volID to the reserved VM vmID on host
// (a fork child, before its agent starts it) by the conditional UPDATE of
// a VM create's attach, with its attachment row, in one transaction. An
// attachment that exists already is no error (a retried fork pass).
func (s *Store) AttachForkVolume(ctx context.Context, vmID, host, volID string, readOnly bool) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		var n int64
		if err := tx.Model(&VolumeAttachment{}).Where("volume_id = ? AND vm_id = ?", volID, vmID).Count(&n).Error; err != nil {
			return fmt.Errorf("read attachment of volume %s to vm %s: %w", volID, vmID, err)
		}
		if n > 0 {
			return nil
		}
		vm := VM{ID: vmID, HostName: host, Volumes: []VMVolume{{VolumeID: volID, ReadOnly: readOnly}}}
		if err := s.attachVolumes(tx, vm); err != nil {
			return err
		}
		err := s.recordVolumeAttachments(tx, vm)
		if isForeignKey(err) || errors.Is(err, gorm.ErrForeignKeyViolated) {
			return fmt.Errorf("vm %s: %w", vmID, ErrNotFound)
		}
		return err
	})
}
