package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// ErrResizing is returned when a VM already has a resize that is not settled.
var ErrResizing = errors.New("a resize of the vm is not settled yet")

// Shape is a VM's vCPUs and memory, what an in-place resize changes.
type Shape struct {
	VCPUs     int64
	MemoryMiB int64
}

// Pending is the shape a VM's unsettled resize applies; ok is false when
// there is none.
func (vm VM) Pending() (Shape, bool) {
	if vm.PendingVCPUs == nil || vm.PendingMemoryMiB == nil {
		return Shape{}, false
	}
	return Shape{VCPUs: *vm.PendingVCPUs, MemoryMiB: *vm.PendingMemoryMiB}, true
}

// held is what the VM counts in its host's allocation: its shape, or while
// a resize is pending the larger of its two shapes per resource.
func (vm VM) held() Resources {
	r := vm.Resources
	if p, ok := vm.Pending(); ok {
		r.VCPUs, r.MemoryMiB = max(r.VCPUs, p.VCPUs), max(r.MemoryMiB, p.MemoryMiB)
	}
	return r
}

// BeginResize reserves a resize of VM id to shape: in one transaction the
// row records the pending shape (only if no other resize is pending and the
// VM holds capacity) and one conditional UPDATE adds the growth (the part
// of shape above the VM's current one) to its host's allocation, only if it
// fits there and the host is alive. A shrink reserves nothing now; its
// release comes when the resize settles. ErrNoRoom when the growth does not
// fit, ErrResizing when another resize is pending, ErrNotFound when there is
// no such VM or it no longer holds capacity.
func (s *Store) BeginResize(ctx context.Context, id string, shape Shape) (VM, error) {
	return s.BeginResizeOwned(ctx, id, shape, nil)
}

// BeginResizeOwned is BeginResize that also records owner, the replica
// running the resize, in the same write (nil keeps the row's owner): once
// its lease lapses the host monitor settles the resize without waiting.
func (s *Store) BeginResizeOwned(ctx context.Context, id string, shape Shape, owner *string) (VM, error) {
	var vm VM
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		t := now()
		res := tx.Exec(`UPDATE vms SET pending_vcpus = ?, pending_memory_mib = ?, resize_started_at = ?, updated_at = ?,
			owner_replica = COALESCE(?, owner_replica)
			WHERE id = ? AND holds_capacity AND pending_vcpus IS NULL`, shape.VCPUs, shape.MemoryMiB, t, t, owner, id)
		if res.Error != nil {
			return fmt.Errorf("record resize of vm %s: %w", id, res.Error)
		}
		var err error
		// Read after the UPDATE, which locks the row: the shape the growth
		// is computed from cannot change under this transaction.
		if vm, err = getVM(tx, id); err != nil {
			return err
		}
		if res.RowsAffected == 0 {
			if _, pending := vm.Pending(); pending {
				return fmt.Errorf("vm %s: %w", id, ErrResizing)
			}
			return fmt.Errorf("vm %s holds no capacity (missing or released): %w", id, ErrNotFound)
		}
		growV, growM := max(0, shape.VCPUs-vm.Resources.VCPUs), max(0, shape.MemoryMiB-vm.Resources.MemoryMiB)
		if growV == 0 && growM == 0 {
			return nil
		}
		// Placement's conditional UPDATE for the growth alone. Not
		// schedulable is no bar: the VM already lives on this host.
		res = tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus + ?, alloc_memory_mib = alloc_memory_mib + ?
			WHERE name = ? AND alive AND alloc_vcpus + ? <= cap_vcpus AND alloc_memory_mib + ? <= cap_memory_mib`,
			growV, growM, vm.HostName, growV, growM)
		if res.Error != nil {
			return fmt.Errorf("reserve resize of vm %s on host %s: %w", id, vm.HostName, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("host %s: %w", vm.HostName, ErrNoRoom)
		}
		// The project's quota after the host (the lock order of
		// reservations); a refusal undoes the host's share with the
		// transaction.
		return s.chargeProject(tx, vm.Project, share{Resources: Resources{VCPUs: growV, MemoryMiB: growM}})
	})
	return vm, err
}

// FinishResize settles VM id's pending resize: applied says whether the VM
// now has the pending shape (the agent applied it) or still its old one. In
// one transaction the row takes that shape, the pending shape is cleared,
// and the host gets back what the other shape held: the shrink of an
// applied resize, the growth of one that was not. It reports whether this
// call settled it (false: there was nothing pending, e.g. another replica
// or the host monitor settled it first).
func (s *Store) FinishResize(ctx context.Context, id string, applied bool) (VM, bool, error) {
	var (
		vm      VM
		settled bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		settled = false
		var err error
		if vm, err = getVM(tx, id); err != nil {
			return err
		}
		p, ok := vm.Pending()
		if !ok {
			return nil
		}
		from, to := vm.Resources, vm.Resources
		if applied {
			to.VCPUs, to.MemoryMiB = p.VCPUs, p.MemoryMiB
		} else {
			from.VCPUs, from.MemoryMiB = p.VCPUs, p.MemoryMiB
		}
		res := tx.Exec(`UPDATE vms SET vcpus = ?, memory_mib = ?, pending_vcpus = NULL, pending_memory_mib = NULL,
			resize_started_at = NULL, updated_at = ?
			WHERE id = ? AND pending_vcpus = ? AND pending_memory_mib = ? AND vcpus = ? AND memory_mib = ?`,
			to.VCPUs, to.MemoryMiB, now(), id, p.VCPUs, p.MemoryMiB, vm.Resources.VCPUs, vm.Resources.MemoryMiB)
		if res.Error != nil {
			return fmt.Errorf("settle resize of vm %s: %w", id, res.Error)
		}
		if res.RowsAffected == 0 {
			return nil // settled (and maybe resized again) since the read: that one counted
		}
		settled = true
		relV, relM := max(0, from.VCPUs-to.VCPUs), max(0, from.MemoryMiB-to.MemoryMiB)
		vm.Resources = to
		vm.PendingVCPUs, vm.PendingMemoryMiB, vm.ResizeStartedAt = nil, nil, nil
		if !vm.HoldsCapacity || (relV == 0 && relM == 0) {
			return nil
		}
		res = tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus - ?, alloc_memory_mib = alloc_memory_mib - ? WHERE name = ?`,
			relV, relM, vm.HostName)
		if res.Error != nil {
			return fmt.Errorf("settle resize of vm %s on host %s: %w", id, vm.HostName, res.Error)
		}
		return creditProject(tx, vm.Project, share{Resources: Resources{VCPUs: relV, MemoryMiB: relM}})
	})
	return vm, settled, err
}

// ResizeAge is how long ago VM vm's pending resize started (0 when none).
func ResizeAge(vm VM) time.Duration {
	if vm.ResizeStartedAt == nil {
		return 0
	}
	return time.Since(*vm.ResizeStartedAt)
}

// RenameVM gives VM id a new name. ErrDuplicateName when another VM has it
// (the unique index decides), ErrNotFound when there is no such VM.
func (s *Store) RenameVM(ctx context.Context, id, name string) error {
	err := updateVMRow(s.db.WithContext(ctx), "rename", id, "UPDATE vms SET name = ?, updated_at = ? WHERE id = ?", name, now(), id)
	if isDuplicate(err) {
		return fmt.Errorf("vm name %q: %w", name, ErrDuplicateName)
	}
	return err
}
