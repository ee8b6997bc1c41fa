package store

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// tombstone records, in the transaction that deletes VM row vm, that it
// was deleted on purpose (deleted_vms).
func tombstone(tx *gorm.DB, vm VM) error {
	err := tx.Exec(`INSERT INTO deleted_vms (vm_id, host_name, deleted_at) VALUES (?, ?, ?)
		ON CONFLICT (vm_id) DO NOTHING`, vm.ID, vm.HostName, now()).Error
	if err != nil {
		return fmt.Errorf("record the delete of vm %s: %w", vm.ID, err)
	}
	return nil
}

// VMWasDeleted reports whether a VM row with this id was deleted on
// purpose (its tombstone is there).
func (s *Store) VMWasDeleted(ctx context.Context, id string) (bool, error) {
	var n int64
	if err := s.db.WithContext(ctx).Raw("SELECT COUNT(*) FROM deleted_vms WHERE vm_id = ?", id).Scan(&n).Error; err != nil {
		return false, fmt.Errorf("look up the delete of vm %s: %w", id, err)
	}
	return n > 0, nil
}

// DeleteOldTombstones removes the tombstones (of VMs and of volumes)
// older than age.
func (s *Store) DeleteOldTombstones(ctx context.Context, age time.Duration) (int64, error) {
	res := s.db.WithContext(ctx).Exec("DELETE FROM deleted_vms WHERE deleted_at < ?", now().Add(-age))
	if res.Error != nil {
		return 0, fmt.Errorf("delete old vm tombstones: %w", res.Error)
	}
	vols := s.db.WithContext(ctx).Exec("DELETE FROM deleted_volumes WHERE deleted_at < ?", now().Add(-age))
	if vols.Error != nil {
		return res.RowsAffected, fmt.Errorf("delete old volume tombstones: %w", vols.Error)
	}
	hosts := s.db.WithContext(ctx).Exec("DELETE FROM deleted_hosts WHERE deleted_at < ?", now().Add(-age))
	if hosts.Error != nil {
		return res.RowsAffected + vols.RowsAffected, fmt.Errorf("delete old host tombstones: %w", hosts.Error)
	}
	return res.RowsAffected + vols.RowsAffected + hosts.RowsAffected, nil
}
