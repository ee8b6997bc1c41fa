package store

import (
	"context"
	"database/sql"
	"fmt"

	"gorm.io/gorm"
)

// ReclaimVM is the inverse of ReleaseVM for a VM marked missing that its
// agent runs after all (an agent that finished a create after the control
// API gave up on it, or that re-adopted its VMs late after a restart): in
// one transaction the VM takes its capacity back, if its host still has
// room, and the agent's state. It reports false with no change when the VM
// is not missing or already holds capacity, ErrNoRoom when the host's
// free capacity no longer fits it, and ErrGroupCap when its group's domain
// filled up meanwhile.
func (s *Store) ReclaimVM(ctx context.Context, id, observedState, reason, startedFrom string) (bool, error) {
	reclaimed := false
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		reclaimed = false // a retried transaction starts over
		vm, err := s.lockVM(tx, id)
		if err != nil {
			return err
		}
		res := tx.Exec(`UPDATE vms SET holds_capacity = TRUE, observed_state = ?, reason = ?,
			started_from = CASE WHEN ? = '' THEN started_from ELSE ? END, updated_at = ?
			WHERE id = ? AND NOT holds_capacity AND observed_state = 'missing'`,
			observedState, reason, startedFrom, startedFrom, now(), id)
		if res.Error != nil {
			return fmt.Errorf("reclaim vm %s: %w", id, res.Error)
		}
		if res.RowsAffected == 0 {
			return nil
		}
		// The host, then the project's usage, then the group slot: the
		// lock order of reservations. Each only under its cap or quota,
		// like a create.
		r := vm.Resources
		// No alive/schedulable condition: the VM already runs there.
		res = tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus + ?, alloc_memory_mib = alloc_memory_mib + ?,
			alloc_disk_mib = alloc_disk_mib + ?
			WHERE name = ? AND alloc_vcpus + ? <= cap_vcpus AND alloc_memory_mib + ? <= cap_memory_mib
				AND alloc_disk_mib + ? <= cap_disk_mib`,
			r.VCPUs, r.MemoryMiB, r.DiskMiB, vm.HostName, r.VCPUs, r.MemoryMiB, r.DiskMiB)
		if res.Error != nil {
			return fmt.Errorf("reclaim vm %s on host %s: %w", id, vm.HostName, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("reclaim vm %s on host %s: %w", id, vm.HostName, ErrNoRoom)
		}
		if err := s.chargeProject(tx, vm.Project, vmShare(vm)); err != nil {
			return fmt.Errorf("reclaim vm %s: %w", id, err)
		}
		if err := takeGroupSlot(tx, vm); err != nil {
			return fmt.Errorf("reclaim vm %s: %w", id, err)
		}
		// Its addresses and MACs come back too, unless another VM took one
		// meanwhile (ErrAddressTaken, ErrMACTaken: nothing changes).
		if err := insertNICRows(s.rawExec(ctx, tx, insertNICSQL), id, vm.NICs); err != nil {
			return err
		}
		reclaimed = true
		return nil
	})
	if err != nil {
		return false, err
	}
	return reclaimed, nil
}

// rawExec runs query in tx without gorm's error translation, so that a
// refusal still names the index that refused (SQLite's message; gorm keeps
// PostgreSQL's error as it is).
func (s *Store) rawExec(ctx context.Context, tx *gorm.DB, query string) func(args ...any) error {
	if sqlTx, ok := tx.Statement.ConnPool.(*sql.Tx); ok && s.dialect == DialectSQLite {
		return func(args ...any) error {
			_, err := sqlTx.ExecContext(ctx, query, args...)
			return err
		}
	}
	return func(args ...any) error { return tx.Exec(query, args...).Error }
}

// SetMissingReason rewrites the reason of a VM that is still missing.
func (s *Store) SetMissingReason(ctx context.Context, id, reason string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE vms SET reason = ?, updated_at = ? WHERE id = ? AND observed_state = 'missing'`,
		reason, now(), id)
	if res.Error != nil {
		return fmt.Errorf("record reason of vm %s: %w", id, res.Error)
	}
	return nil
}
