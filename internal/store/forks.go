package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// Fork is a row of forks. Its id is also the snapshot id on the agents.
type Fork struct {
	ID         string `gorm:"column:id;primaryKey"`
	SourceVMID string `gorm:"column:source_vm_id"`
	// Project is the source's project, which its children belong to.
	Project     string    `gorm:"column:project"`
	SourceHost  string    `gorm:"column:source_host"`
	Image       string    `gorm:"column:image"`
	Resources   Resources `gorm:"embedded"`
	Count       int       `gorm:"column:child_count"`
	PauseSource bool      `gorm:"column:pause_source"`
	Placement   string    `gorm:"column:placement"`
	// Constraints are the children's placement constraints (JSON, "" for none).
	Constraints   string `gorm:"column:constraints"`
	SnapshotTaken bool   `gorm:"column:snapshot_taken"`
	// SnapshotHosts are the hosts that may hold the snapshot (JSON list).
	SnapshotHosts []string `gorm:"column:snapshot_hosts;serializer:json"`
	Phase         string   `gorm:"column:phase"`
	Error         string   `gorm:"column:error"`
	// Attempts counts the passes that failed in a row; RetryAt is when the
	// host monitor runs the next (nil: none is due, see RecordForkFailure).
	Attempts       int        `gorm:"column:attempts"`
	RetryAt        *time.Time `gorm:"column:retry_at"`
	IdempotencyKey *string    `gorm:"column:idempotency_key"`
	// IdempotencyCaller is who sent IdempotencyKey (see IdempotencyRecord).
	IdempotencyCaller string `gorm:"column:idempotency_caller"`
	// NICs are the source's NICs when the fork was made: each child gets
	// its own on the same networks.
	NICs []NIC `gorm:"column:nics;serializer:json"`
	// Owner is the control replica running the fork's pass (replicas.go).
	Owner *string `gorm:"column:owner_replica"`
	// Guest is the source VM's guest configuration when the fork was made:
	// each child gets a seed of its own from it (nil: none).
	Guest *Guest `gorm:"column:guest;serializer:json"`
	// GuestAgent: the source VM had the QEMU guest agent channel; its
	// children have it too.
	GuestAgent bool `gorm:"column:guest_agent"`
	// SecureBoot is the source's, which its children keep.
	SecureBoot bool      `gorm:"column:secure_boot"`
	CreatedAt  time.Time `gorm:"column:created_at"`
	UpdatedAt  time.Time `gorm:"column:updated_at"`
}

// TableName is the table of Fork.
func (Fork) TableName() string { return "forks" }

// InsertFork inserts a new fork. ErrDuplicateName when its idempotency key
// already names another fork.
func (s *Store) InsertFork(ctx context.Context, f Fork) error {
	t := now()
	if f.CreatedAt.IsZero() {
		f.CreatedAt = t
	}
	f.UpdatedAt = t
	if f.SnapshotHosts == nil {
		f.SnapshotHosts = []string{f.SourceHost}
	}
	if f.NICs == nil {
		f.NICs = []NIC{}
	}
	err := s.db.WithContext(ctx).Create(&f).Error
	if isDuplicate(err) {
		return fmt.Errorf("fork %s: %w", f.ID, ErrDuplicateName)
	}
	if err != nil {
		return fmt.Errorf("insert fork %s: %w", f.ID, err)
	}
	return nil
}

// GetFork returns one fork; ErrNotFound when there is none with this id.
func (s *Store) GetFork(ctx context.Context, id string) (Fork, error) {
	return s.takeFork(ctx, "id = ?", id)
}

// GetForkByIdempotencyKey returns the fork a POST of caller with this key made.
func (s *Store) GetForkByIdempotencyKey(ctx context.Context, caller, key string) (Fork, error) {
	return s.takeFork(ctx, "idempotency_caller = ? AND idempotency_key = ?", caller, key)
}

// takeFork reads the fork where matches; its last argument names it in errors.
func (s *Store) takeFork(ctx context.Context, where string, args ...any) (Fork, error) {
	var f Fork
	err := s.db.WithContext(ctx).Where(where, args...).Take(&f).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Fork{}, fmt.Errorf("fork %v: %w", args[len(args)-1], ErrNotFound)
	}
	if err != nil {
		return Fork{}, fmt.Errorf("read fork %v: %w", args[len(args)-1], err)
	}
	return f, nil
}

// UnfinishedForks lists the forks whose last pass did not end ready nor
// failed for good, that were last written before `before`, and whose
// retry (if a failed pass set one) is due.
func (s *Store) UnfinishedForks(ctx context.Context, before time.Time) ([]Fork, error) {
	var out []Fork
	q := s.db.WithContext(ctx).Where("phase NOT IN (?, ?) AND updated_at < ? AND (retry_at IS NULL OR retry_at <= ?)",
		"ready", "failed", before.UTC(), now()).Order("id")
	if err := q.Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list unfinished forks: %w", err)
	}
	return out, nil
}

// MarkForkSnapshotTaken durably records that the fork's snapshot exists.
// No child of the fork may exist before this write has committed.
func (s *Store) MarkForkSnapshotTaken(ctx context.Context, id string) error {
	return s.updateFork(ctx, id, map[string]any{"snapshot_taken": true})
}

// SetForkPhase records a fork's phase and error message.
func (s *Store) SetForkPhase(ctx context.Context, id, phase, errMsg string) error {
	return s.updateFork(ctx, id, map[string]any{"phase": phase, "error": errMsg})
}

// SetForkReady records that a pass brought the fork to its desired state:
// no error, no failed attempt, no retry due.
func (s *Store) SetForkReady(ctx context.Context, id string) error {
	return s.updateFork(ctx, id, map[string]any{"phase": "ready", "error": "", "attempts": 0, "retry_at": nil})
}

// RecordForkFailure records a failed pass: the phase ("retrying" or the
// terminal "failed"), its reason, the failed passes in a row, and when
// the next retry is due (nil: none).
func (s *Store) RecordForkFailure(ctx context.Context, id, phase, errMsg string, attempts int, retryAt *time.Time) error {
	var at any
	if retryAt != nil {
		at = retryAt.UTC()
	}
	return s.updateFork(ctx, id, map[string]any{"phase": phase, "error": errMsg, "attempts": attempts, "retry_at": at})
}

// SetForkCount records a new number of children.
func (s *Store) SetForkCount(ctx context.Context, id string, count int) error {
	return s.updateFork(ctx, id, map[string]any{"child_count": count})
}

// SetForkConstraints replaces the constraints of the children to come.
func (s *Store) SetForkConstraints(ctx context.Context, id, constraints string) error {
	return s.updateFork(ctx, id, map[string]any{"constraints": constraints})
}

func (s *Store) updateFork(ctx context.Context, id string, cols map[string]any) error {
	cols["updated_at"] = now()
	res := s.db.WithContext(ctx).Model(&Fork{}).Where("id = ?", id).Updates(cols)
	if res.Error != nil {
		return fmt.Errorf("update fork %s: %w", id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("fork %s: %w", id, ErrNotFound)
	}
	return nil
}

// AddForkSnapshotHost records that host may hold a copy of the fork's
// snapshot (before a child there is asked to pull it).
func (s *Store) AddForkSnapshotHost(ctx context.Context, id, host string) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		var f Fork
		q := tx.Where("id = ?", id)
		if s.dialect == DialectPostgres {
			// Row lock: two passes adding hosts at once must not lose one.
			q = q.Clauses(clause.Locking{Strength: "UPDATE"})
		}
		if err := q.Take(&f).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return fmt.Errorf("fork %s: %w", id, ErrNotFound)
			}
			return fmt.Errorf("read fork %s: %w", id, err)
		}
		if slices.Contains(f.SnapshotHosts, host) {
			return nil
		}
		b, err := json.Marshal(append(f.SnapshotHosts, host))
		if err != nil {
			return err
		}
		res := tx.Exec("UPDATE forks SET snapshot_hosts = ?, updated_at = ? WHERE id = ?", string(b), now(), id)
		if res.Error != nil {
			return fmt.Errorf("record snapshot host %s of fork %s: %w", host, id, res.Error)
		}
		return nil
	})
}

// DeleteFork removes the fork row (its children must be gone already).
func (s *Store) DeleteFork(ctx context.Context, id string) error {
	if err := s.db.WithContext(ctx).Exec("DELETE FROM forks WHERE id = ?", id).Error; err != nil {
		return fmt.Errorf("delete fork %s: %w", id, err)
	}
	return nil
}
