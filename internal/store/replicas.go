package store

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm/clause"
)

// Replica is a row of replicas: one control replica's lease. A replica
// renews heartbeat_at every few seconds while it runs; once the heartbeat
// is older than the lapse the replica counts as gone, and what it owned
// (creates, resizes and forks in flight) is settled by another replica.
// Leases compare times written by the replicas' own clocks: their clocks
// must agree to well within the lapse (NTP does).
type Replica struct {
	ID          string    `gorm:"column:id;primaryKey"`
	StartedAt   time.Time `gorm:"column:started_at"`
	HeartbeatAt time.Time `gorm:"column:heartbeat_at"`
}

// TableName is the table of Replica.
func (Replica) TableName() string { return "replicas" }

// Heartbeat renews replica id's lease (creating its row the first time).
func (s *Store) Heartbeat(ctx context.Context, id string, startedAt time.Time) error {
	r := Replica{ID: id, StartedAt: startedAt.UTC(), HeartbeatAt: now()}
	err := s.db.WithContext(ctx).Clauses(clause.OnConflict{
		Columns:   []clause.Column{{Name: "id"}},
		DoUpdates: clause.AssignmentColumns([]string{"heartbeat_at"}),
	}).Create(&r).Error
	if err != nil {
		return fmt.Errorf("renew the lease of replica %s: %w", id, err)
	}
	return nil
}

// DropReplica removes replica id's lease (a clean stop): what it still
// owned is settled by the others at once.
func (s *Store) DropReplica(ctx context.Context, id string) error {
	if err := s.db.WithContext(ctx).Exec("DELETE FROM replicas WHERE id = ?", id).Error; err != nil {
		return fmt.Errorf("drop the lease of replica %s: %w", id, err)
	}
	return nil
}

// DropOtherReplicas removes every lease but self's: a single replica (on
// SQLite) that starts knows every other replica is gone, so what they
// owned is settled without waiting for their leases to lapse.
func (s *Store) DropOtherReplicas(ctx context.Context, self string) (int64, error) {
	res := s.db.WithContext(ctx).Exec("DELETE FROM replicas WHERE id <> ?", self)
	if res.Error != nil {
		return 0, fmt.Errorf("drop the leases of other replicas: %w", res.Error)
	}
	return res.RowsAffected, nil
}

// LiveReplicas returns the ids of the replicas whose heartbeat is newer
// than lapse ago. Leases that lapsed long ago (an hour) are deleted on the way.
func (s *Store) LiveReplicas(ctx context.Context, lapse time.Duration) (map[string]bool, error) {
	t := now()
	db := s.db.WithContext(ctx)
	if err := db.Exec("DELETE FROM replicas WHERE heartbeat_at < ?", t.Add(-time.Hour-lapse)).Error; err != nil {
		return nil, fmt.Errorf("delete old replica leases: %w", err)
	}
	var ids []string
	if err := db.Raw("SELECT id FROM replicas WHERE heartbeat_at >= ?", t.Add(-lapse)).Scan(&ids).Error; err != nil {
		return nil, fmt.Errorf("read replica leases: %w", err)
	}
	live := make(map[string]bool, len(ids))
	for _, id := range ids {
		live[id] = true
	}
	return live, nil
}

// TakeFork makes replica `to` the owner of fork id if its owner is still
// `from` (nil: no owner): of the replicas that saw the same lapsed owner,
// exactly one takes the fork over. It reports whether this call did.
func (s *Store) TakeFork(ctx context.Context, id string, from *string, to string) (bool, error) {
	q := "UPDATE forks SET owner_replica = ?, updated_at = ? WHERE id = ? AND owner_replica = ?"
	args := []any{to, now(), id, from}
	if from == nil {
		q = "UPDATE forks SET owner_replica = ?, updated_at = ? WHERE id = ? AND owner_replica IS NULL"
		args = args[:3]
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take over fork %s: %w", id, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// SetForkOwner records the replica that runs fork id's pass now.
func (s *Store) SetForkOwner(ctx context.Context, id, owner string) error {
	return s.updateFork(ctx, id, map[string]any{"owner_replica": owner})
}

// TakeVM makes replica `to` the owner of VM id if its owner is still
// `from`: of the replicas that saw the same lapsed owner, exactly one
// settles the VM's unfinished create or resize.
func (s *Store) TakeVM(ctx context.Context, id string, from *string, to string) (bool, error) {
	q := "UPDATE vms SET owner_replica = ? WHERE id = ? AND owner_replica = ?"
	args := []any{to, id, from}
	if from == nil {
		q = "UPDATE vms SET owner_replica = ? WHERE id = ? AND owner_replica IS NULL"
		args = args[:2]
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take over vm %s: %w", id, res.Error)
	}
	return res.RowsAffected == 1, nil
}
