package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// Migration states (vm_migrations.state; 0024_vm_migrations.sql).
const (
	// MigrationReserved: the target's share is held; the agents may or
	// may not have been asked yet.
	MigrationReserved = "reserved"
	// MigrationMoving: the source was asked to migrate the VM.
	MigrationMoving = "moving"
	// MigrationSwitched: the VM runs on the target, its row points there
	// and the source's share is released; the source's stopped copy is
	// still to be deleted.
	MigrationSwitched = "switched"
)

// ErrMigrating is returned when a VM already has a migration that is not
// finished.
var ErrMigrating = errors.New("the vm is being migrated")

// Migration is a row of vm_migrations: one VM on its way from SourceHost
// to TargetHost.
type Migration struct {
	VMID       string `gorm:"column:vm_id;primaryKey"`
	SourceHost string `gorm:"column:source_host"`
	TargetHost string `gorm:"column:target_host"`
	State      string `gorm:"column:state"`
	// Live: the VM runs on the source and moves running (a cold one is
	// stopped there and moves as files).
	Live bool `gorm:"column:live"`
	// Resources is what the target holds for the VM until the switch or
	// the undo.
	Resources Resources `gorm:"embedded"`
	// TargetDomain is the group domain whose slot the reservation took on
	// the target ("" when it took none: no group, or the same domain).
	TargetDomain string `gorm:"column:target_domain"`
	// DrainHost is the host whose drain started the migration ("" for a
	// migration asked for by a user).
	DrainHost   string  `gorm:"column:drain_host"`
	Phase       string  `gorm:"column:phase"`
	Transferred int64   `gorm:"column:transferred"`
	Total       int64   `gorm:"column:total"`
	Owner       *string `gorm:"column:owner_replica"`
	// Volumes are the VM's read-write volumes that move with it
	// (0026_migration_volumes.sql): the target's reservation holds their
	// sizes beside Resources, and the switch moves their rows.
	Volumes   []MigrationVolume `gorm:"column:volumes;serializer:json"`
	StartedAt time.Time         `gorm:"column:started_at"`
	UpdatedAt time.Time         `gorm:"column:updated_at"`
}

// TableName is the table of Migration.
func (Migration) TableName() string { return "vm_migrations" }

// MigrationVolume is one volume that moves with its VM, with the size the
// reservation took for it.
type MigrationVolume struct {
	ID      string `json:"id"`
	SizeMiB int64  `json:"size_mib"`
}

// VolumeDiskMiB is the disk the migration's volumes hold on the target.
func (m Migration) VolumeDiskMiB() int64 {
	var n int64
	for _, v := range m.Volumes {
		n += v.SizeMiB
	}
	return n
}

// MigrationVolumeError is why a VM's volume cannot move with it now: it
// is attached read-only (it may be shared), shared, being attached or
// detached, moving, or not ready on the VM's host. It unwraps to
// ErrVolumeNotReady.
type MigrationVolumeError struct {
	VM, Volume, Name, Why string
}

func (e *MigrationVolumeError) Error() string {
	return fmt.Sprintf("volume %s (%s) of vm %s %s", e.Name, e.Volume, e.VM, e.Why)
}

// Unwrap makes errors.Is(err, ErrVolumeNotReady) hold.
func (e *MigrationVolumeError) Unwrap() error { return ErrVolumeNotReady }

// migrationVolumes reads (and on PostgreSQL locks, in id order) the
// volumes of vm, which is to move from host: each must be attached
// read-write (settled, not attaching or detaching), ready on host and not
// moving; a *MigrationVolumeError names the first that is not.
func (s *Store) migrationVolumes(tx *gorm.DB, vm VM, host string) ([]MigrationVolume, error) {
	var atts []AttachmentStep
	if err := tx.Table("volume_attachments").Where("vm_id = ?", vm.ID).Order("volume_id").Find(&atts).Error; err != nil {
		return nil, fmt.Errorf("read volumes of vm %s: %w", vm.ID, err)
	}
	out := make([]MigrationVolume, 0, len(atts))
	for _, a := range atts {
		v, err := s.lockVolume(tx, a.VolumeID)
		if err != nil {
			return nil, err
		}
		refuse := func(why string) error {
			return &MigrationVolumeError{VM: vm.ID, Volume: v.ID, Name: v.Name, Why: why}
		}
		switch {
		case a.State != AttachmentAttached:
			return nil, refuse("is " + a.State)
		case a.ReadOnly:
			return nil, refuse("is attached read-only")
		case v.State != VolumeReady || v.MoveTarget != nil || v.MoveSource != nil:
			return nil, refuse("is " + v.State)
		case v.HostName != host || !v.HoldsCapacity:
			return nil, refuse("is not on host " + host)
		}
		out = append(out, MigrationVolume{ID: v.ID, SizeMiB: v.SizeMiB})
	}
	return out, nil
}

// refuseWhileMigrating is ErrMigrating when VM id has an unfinished
// migration (the caller holds the VM's row).
func refuseWhileMigrating(tx *gorm.DB, id, what string) error {
	var n int64
	if err := tx.Raw("SELECT COUNT(*) FROM vm_migrations WHERE vm_id = ?", id).Scan(&n).Error; err != nil {
		return fmt.Errorf("read migration of vm %s: %w", id, err)
	}
	if n > 0 {
		return fmt.Errorf("vm %s is being migrated, so %s waits: retry once the migration has finished: %w", id, what, ErrMigrating)
	}
	return nil
}

// BeginMigration reserves the target of a migration of VM m.VMID from
// m.SourceHost to m.TargetHost: in one transaction the migration row is
// inserted (the primary key refuses a second migration of the VM:
// ErrMigrating), the VM's group takes a slot in the target's domain
// targetDomain when that is not the domain it holds a slot in now, and the
// create's conditional UPDATE adds the VM's resources to the target only if
// they fit there and the target is alive, schedulable and not draining
// (ErrNoRoom; ErrGroupCap for the slot). The VM must hold capacity on
// m.SourceHost and have no pending resize (ErrNotFound, ErrResizing).
// The project is not charged again: the VM counts once in its quota.
//
// The VM's volumes move with it: m.Volumes is set to them (each attached
// read-write, ready on the source: a *MigrationVolumeError otherwise) and
// the same UPDATE reserves their sizes on the target with the VM's disk.
func (s *Store) BeginMigration(ctx context.Context, m Migration, targetDomain string) (Migration, error) {
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		vm, err := s.lockVM(tx, m.VMID)
		if err != nil {
			return err
		}
		if !vm.HoldsCapacity || vm.HostName != m.SourceHost {
			return fmt.Errorf("vm %s holds no capacity on host %s (it is on %s): %w", m.VMID, m.SourceHost, vm.HostName, ErrNotFound)
		}
		if _, pending := vm.Pending(); pending {
			return fmt.Errorf("vm %s: %w", m.VMID, ErrResizing)
		}
		if m.Volumes, err = s.migrationVolumes(tx, vm, m.SourceHost); err != nil {
			return err
		}
		t := now()
		m.State, m.Resources, m.StartedAt, m.UpdatedAt = MigrationReserved, vm.Resources, t, t
		m.TargetDomain = ""
		if vm.Group.Name != "" && targetDomain != vm.Group.Domain {
			m.TargetDomain = targetDomain
		}
		if err := tx.Create(&m).Error; err != nil {
			if isDuplicate(err) {
				return fmt.Errorf("vm %s: %w", m.VMID, ErrMigrating)
			}
			if isForeignKey(err) {
				return fmt.Errorf("host %s: %w", m.TargetHost, ErrNotFound)
			}
			return fmt.Errorf("record migration of vm %s: %w", m.VMID, err)
		}
		// The lock order of a reservation: the host, then the group slot.
		r := m.Resources
		disk := r.DiskMiB + m.VolumeDiskMiB()
		res := tx.Exec(reserveOnHostSQL, r.VCPUs, r.MemoryMiB, disk, m.TargetHost, r.VCPUs, r.MemoryMiB, disk)
		if res.Error != nil {
			return fmt.Errorf("reserve migration of vm %s on host %s: %w", m.VMID, m.TargetHost, res.Error)
		}
		if res.RowsAffected != 1 {
			return fmt.Errorf("host %s: %w", m.TargetHost, ErrNoRoom)
		}
		if m.TargetDomain != "" {
			slot := vm
			slot.Group.Domain = m.TargetDomain
			if err := takeGroupSlot(tx, slot); err != nil {
				return err
			}
		}
		return nil
	})
	if pgCode(err) == "23514" {
		err = fmt.Errorf("group domain %s is at its cap: %w", targetDomain, ErrGroupCap)
	}
	return m, err
}

// GetMigration returns VM id's migration; ErrNotFound when it has none.
func (s *Store) GetMigration(ctx context.Context, id string) (Migration, error) {
	var m Migration
	err := s.db.WithContext(ctx).Where("vm_id = ?", id).Take(&m).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Migration{}, fmt.Errorf("migration of vm %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Migration{}, fmt.Errorf("read migration of vm %s: %w", id, err)
	}
	return m, nil
}

// ListMigrations returns every unfinished migration, oldest first.
func (s *Store) ListMigrations(ctx context.Context) ([]Migration, error) {
	var out []Migration
	if err := s.db.WithContext(ctx).Order("started_at, vm_id").Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list migrations: %w", err)
	}
	return out, nil
}

// MigrationsOf returns the unfinished migrations of the VMs ids, by VM.
func (s *Store) MigrationsOf(ctx context.Context, ids []string) (map[string]Migration, error) {
	out := map[string]Migration{}
	if len(ids) == 0 {
		return out, nil
	}
	var rows []Migration
	for chunk := range chunks(ids, 500) {
		if err := s.db.WithContext(ctx).Where("vm_id IN ?", chunk).Find(&rows).Error; err != nil {
			return nil, fmt.Errorf("read migrations: %w", err)
		}
		for _, m := range rows {
			out[m.VMID] = m
		}
	}
	return out, nil
}

func chunks(ids []string, n int) func(func([]string) bool) {
	return func(yield func([]string) bool) {
		for len(ids) > 0 {
			k := min(n, len(ids))
			if !yield(ids[:k]) {
				return
			}
			ids = ids[k:]
		}
	}
}

// SetMigrationState moves VM id's migration from state from to state to;
// false when it is not in from (another replica or the monitor moved it).
func (s *Store) SetMigrationState(ctx context.Context, id, from, to string) (bool, error) {
	res := s.db.WithContext(ctx).Exec("UPDATE vm_migrations SET state = ?, updated_at = ? WHERE vm_id = ? AND state = ?",
		to, now(), id, from)
	if res.Error != nil {
		return false, fmt.Errorf("record migration of vm %s as %s: %w", id, to, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// SetMigrationProgress records how far VM id's migration is (shown in the
// VM's answer while it runs).
func (s *Store) SetMigrationProgress(ctx context.Context, id, phase string, transferred, total int64) error {
	return s.db.WithContext(ctx).Exec(`UPDATE vm_migrations SET phase = ?, transferred = ?, total = ?, updated_at = ?
		WHERE vm_id = ? AND state <> ?`, phase, transferred, total, now(), id, MigrationSwitched).Error
}

// TakeMigration makes replica `to` the owner of VM id's migration if its
// owner is still `from`: of the replicas that saw the same lapsed owner,
// exactly one finishes or undoes it.
func (s *Store) TakeMigration(ctx context.Context, id string, from *string, to string) (bool, error) {
	q := "UPDATE vm_migrations SET owner_replica = ? WHERE vm_id = ? AND owner_replica = ?"
	args := []any{to, id, from}
	if from == nil {
		q = "UPDATE vm_migrations SET owner_replica = ? WHERE vm_id = ? AND owner_replica IS NULL"
		args = args[:2]
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take over migration of vm %s: %w", id, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// SwitchMigration records that VM id runs on its migration's target: in
// one transaction the VM row points at the target (and its group slot at
// the target's domain), the source's share is released (with the source
// domain's slot when the target's was taken), and the migration becomes
// switched; the migration's volume rows move to the target with it and
// their sizes leave the source. It reports whether this call switched it (false: it was
// switched already). ErrNotFound when there is no unswitched migration or
// the VM no longer holds capacity on the source (then the migration is
// to be undone instead).
func (s *Store) SwitchMigration(ctx context.Context, id string) (VM, bool, error) {
	var (
		vm       VM
		switched bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		switched = false
		var err error
		if vm, err = s.lockVM(tx, id); err != nil {
			return err
		}
		var m Migration
		if err := tx.Where("vm_id = ?", id).Take(&m).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return fmt.Errorf("migration of vm %s: %w", id, ErrNotFound)
			}
			return err
		}
		if m.State == MigrationSwitched {
			return nil
		}
		if !vm.HoldsCapacity || vm.HostName != m.SourceHost {
			return fmt.Errorf("vm %s holds no capacity on host %s: %w", id, m.SourceHost, ErrNotFound)
		}
		source := vm.Group
		target := vm.Group
		if m.TargetDomain != "" {
			target.Domain = m.TargetDomain
		}
		res := tx.Exec(`UPDATE vms SET host_name = ?, spread_domain = ?, updated_at = ? WHERE id = ? AND host_name = ? AND holds_capacity`,
			m.TargetHost, target.Domain, now(), id, m.SourceHost)
		if res.Error != nil {
			return fmt.Errorf("switch vm %s to host %s: %w", id, m.TargetHost, res.Error)
		}
		if res.RowsAffected != 1 {
			return fmt.Errorf("vm %s left host %s meanwhile: %w", id, m.SourceHost, ErrNotFound)
		}
		for _, v := range m.Volumes {
			// The target holds the volume's size since the reservation.
			res := tx.Exec(`UPDATE volumes SET host_name = ?, updated_at = ? WHERE id = ? AND host_name = ? AND size_mib = ? AND holds_capacity`,
				m.TargetHost, now(), v.ID, m.SourceHost, v.SizeMiB)
			if res.Error != nil {
				return fmt.Errorf("switch volume %s of vm %s to host %s: %w", v.ID, id, m.TargetHost, res.Error)
			}
			if res.RowsAffected != 1 {
				return fmt.Errorf("volume %s of vm %s is no longer %d MiB on host %s: %w", v.ID, id, v.SizeMiB, m.SourceHost, ErrVolumeNotReady)
			}
		}
		r := vm.held()
		res = tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus - ?, alloc_memory_mib = alloc_memory_mib - ?,
			alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, r.VCPUs, r.MemoryMiB, r.DiskMiB+m.VolumeDiskMiB(), m.SourceHost)
		if res.Error != nil {
			return fmt.Errorf("release vm %s on host %s: %w", id, m.SourceHost, res.Error)
		}
		if m.TargetDomain != "" {
			if err := giveGroupSlot(tx, source); err != nil {
				return err
			}
		}
		res = tx.Exec("UPDATE vm_migrations SET state = ?, updated_at = ? WHERE vm_id = ? AND state <> ?",
			MigrationSwitched, now(), id, MigrationSwitched)
		if res.Error != nil {
			return fmt.Errorf("record switch of vm %s: %w", id, res.Error)
		}
		vm.HostName, vm.Group = m.TargetHost, target
		switched = true
		return nil
	})
	return vm, switched, err
}

// AbortMigration undoes VM id's unswitched migration: in one transaction
// the row goes and the target gives back what it held, the VM's share and
// its volumes' (and the group slot
// of the target's domain). It reports whether this call undid it (false:
// there was none, or it has switched: a switched migration is finished,
// never undone).
func (s *Store) AbortMigration(ctx context.Context, id string) (bool, error) {
	undone := false
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		undone = false
		vm, err := s.lockVM(tx, id)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		var m Migration
		if err := tx.Where("vm_id = ? AND state <> ?", id, MigrationSwitched).Take(&m).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return nil
			}
			return err
		}
		res := tx.Exec("DELETE FROM vm_migrations WHERE vm_id = ? AND state <> ?", id, MigrationSwitched)
		if res.Error != nil || res.RowsAffected != 1 {
			return res.Error
		}
		r := m.Resources
		if err := tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus - ?, alloc_memory_mib = alloc_memory_mib - ?,
			alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, r.VCPUs, r.MemoryMiB, r.DiskMiB+m.VolumeDiskMiB(), m.TargetHost).Error; err != nil {
			return fmt.Errorf("release migration of vm %s on host %s: %w", id, m.TargetHost, err)
		}
		if m.TargetDomain != "" {
			slot := vm.Group
			slot.Domain = m.TargetDomain
			if err := giveGroupSlot(tx, slot); err != nil {
				return err
			}
		}
		undone = true
		return nil
	})
	return undone, err
}

// FinishMigration removes VM id's switched migration once the source has
// deleted its copy; false when there was none.
func (s *Store) FinishMigration(ctx context.Context, id string) (bool, error) {
	res := s.db.WithContext(ctx).Exec("DELETE FROM vm_migrations WHERE vm_id = ? AND state = ?", id, MigrationSwitched)
	if res.Error != nil {
		return false, fmt.Errorf("finish migration of vm %s: %w", id, res.Error)
	}
	return res.RowsAffected == 1, nil
}
