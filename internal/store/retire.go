package store

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"
)

// RetireHost retires host name, whose agent is gone for good, in one
// transaction: the host is marked retired and not alive (the reservation's
// condition; nothing marks a retired host alive again);
// every VM placed on it is marked lost (observed state lostState, with reason) and
// gives its capacity, group slot, addresses and MACs back; the host's
// allocation ends at zero. The host row is locked first, so a reservation
// racing the retire either commits before it (and its VM is marked lost
// too) or finds the host not alive. A host that still has volumes (other
// than ones being deleted, whose delete the retire finishes) is refused
// with a *VolumesOnHostError: their data is on that host only, so their
// owners move or delete them first. A host already retired is returned
// unchanged with no VM ids. ErrNotFound when there is no such host.
func (s *Store) RetireHost(ctx context.Context, name, lostState, reason string) (Host, []string, error) {
	var (
		h    Host
		lost []string
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		lost = nil // a retried transaction starts over
		t := now()
		res := tx.Exec(`UPDATE hosts SET retired_at = ?, alive = FALSE, updated_at = ?
			WHERE name = ? AND retired_at IS NULL`, t, t, name)
		if res.Error != nil {
			return fmt.Errorf("retire host %s: %w", name, res.Error)
		}
		if res.RowsAffected == 0 {
			return nil // unknown (read below) or retired already
		}
		if err := volumesBlockRetire(tx, name); err != nil {
			return err
		}
		var ids []string
		if err := tx.Raw("SELECT id FROM vms WHERE host_name = ? ORDER BY id", name).Scan(&ids).Error; err != nil {
			return fmt.Errorf("retire host %s: read its vms: %w", name, err)
		}
		for _, id := range ids {
			vm, err := s.lockVM(tx, id)
			if err != nil {
				return fmt.Errorf("retire host %s: %w", name, err)
			}
			if _, err := releaseInTx(tx, vm); err != nil {
				return fmt.Errorf("retire host %s: %w", name, err)
			}
			if err := tx.Exec(`UPDATE vms SET observed_state = ?, reason = ?, updated_at = ? WHERE id = ?`,
				lostState, reason, t, id).Error; err != nil {
				return fmt.Errorf("retire host %s: mark vm %s lost: %w", name, id, err)
			}
			lost = append(lost, id)
		}
		// What volumes are left are being deleted (volumesBlockRetire let
		// nothing else through): their delete is finished here, as the
		// agent that would confirm it is gone with the host's disks.
		var vols []Volume
		if err := tx.Where("host_name = ?", name).Order("id").Find(&vols).Error; err != nil {
			return fmt.Errorf("retire host %s: read its volumes: %w", name, err)
		}
		for _, v := range vols {
			if _, err := releaseVolumeInTx(tx, v); err != nil {
				return fmt.Errorf("retire host %s: %w", name, err)
			}
			if err := tombstoneVolume(tx, v); err != nil {
				return fmt.Errorf("retire host %s: %w", name, err)
			}
			if err := tx.Exec("DELETE FROM volumes WHERE id = ?", v.ID).Error; err != nil {
				return fmt.Errorf("retire host %s: delete volume %s: %w", name, v.ID, err)
			}
		}
		// Every VM and volume gave its share back, so the allocation is zero now; set
		// so, it also ends any drift the host had. The warm pool went with
		// the agent.
		if err := tx.Exec(`UPDATE hosts SET alloc_vcpus = 0, alloc_memory_mib = 0, alloc_disk_mib = 0,
			warm_vcpus = 0, warm_memory_mib = 0, warm_disk_mib = 0 WHERE name = ?`, name).Error; err != nil {
			return fmt.Errorf("retire host %s: release its capacity: %w", name, err)
		}
		return nil
	})
	if err != nil {
		return Host{}, nil, err
	}
	h, err = s.GetHost(ctx, name)
	if err != nil {
		return Host{}, nil, err
	}
	if h.RetiredAt == nil {
		return Host{}, nil, errors.New("retire host " + name + ": the host row was not retired; retry")
	}
	return h, lost, nil
}
