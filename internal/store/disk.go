package store

import (
	"context"
	"fmt"

	"gorm.io/gorm"
)

// GrowVMDisk reserves the growth of VM id's disk from one size to another
// and records the new size, in one transaction: one conditional UPDATE adds
// the growth to its host's allocation only if it fits there, and the row
// changes only if it still has the size the caller read (so two concurrent
// growths never both count). ErrNoRoom when it does not fit, ErrNotFound
// when the VM is gone or its size changed meanwhile.
func (s *Store) GrowVMDisk(ctx context.Context, id, host string, from, to int64) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		res := tx.Exec(`UPDATE vms SET disk_mib = ?, updated_at = ? WHERE id = ? AND disk_mib = ? AND holds_capacity`,
			to, now(), id, from)
		if res.Error != nil {
			return fmt.Errorf("record disk of vm %s: %w", id, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("vm %s with a %d MiB disk: %w", id, from, ErrNotFound)
		}
		var project string
		if err := tx.Raw("SELECT project FROM vms WHERE id = ?", id).Scan(&project).Error; err != nil {
			return fmt.Errorf("read project of vm %s: %w", id, err)
		}
		res = tx.Exec(`UPDATE hosts SET alloc_disk_mib = alloc_disk_mib + ? WHERE name = ? AND alloc_disk_mib + ? <= cap_disk_mib`,
			to-from, host, to-from)
		if res.Error != nil {
			return fmt.Errorf("reserve disk on host %s: %w", host, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("host %s: %d MiB more disk: %w", host, to-from, ErrNoRoom)
		}
		// The project after the host: the lock order of reservations.
		return s.chargeProject(tx, project, share{Resources: Resources{DiskMiB: to - from}})
	})
}

// UndoGrowVMDisk takes back a GrowVMDisk whose agent call failed.
func (s *Store) UndoGrowVMDisk(ctx context.Context, id, host string, from, to int64) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		res := tx.Exec(`UPDATE vms SET disk_mib = ?, updated_at = ? WHERE id = ? AND disk_mib = ? AND holds_capacity`,
			from, now(), id, to)
		if res.Error != nil {
			return res.Error
		}
		if res.RowsAffected == 0 {
			return nil // released or changed meanwhile: nothing of ours to undo
		}
		var project string
		if err := tx.Raw("SELECT project FROM vms WHERE id = ?", id).Scan(&project).Error; err != nil {
			return fmt.Errorf("read project of vm %s: %w", id, err)
		}
		if err := tx.Exec(`UPDATE hosts SET alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, to-from, host).Error; err != nil {
			return err
		}
		return creditProject(tx, project, share{Resources: Resources{DiskMiB: to - from}})
	})
}
