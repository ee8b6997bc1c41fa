package store

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Drain states (hosts.drain_state; 0025_host_drain.sql). A host in any of
// them but DrainNone takes no new VM.
const (
	DrainNone       = ""
	DrainDraining   = "draining"
	DrainDrained    = "drained"
	DrainIncomplete = "incomplete"
)

// ErrLastHost is returned when a drain would leave no host to place on.
var ErrLastHost = errors.New("no other host is alive, schedulable and not draining")

// Drain is a host's drain: its state and how far it is.
type Drain struct {
	State string `gorm:"column:state"`
	// Total is how many VMs the host had when the drain started; Moved
	// how many have left it since.
	Total  int64         `gorm:"column:total"`
	Moved  int64         `gorm:"column:moved"`
	Failed DrainFailures `gorm:"column:failed;serializer:json"`
	// Owner is the replica that runs the drain pass.
	Owner     *string    `gorm:"column:owner"`
	StartedAt *time.Time `gorm:"column:started_at"`
}

// DrainFailures are the VMs a drain could not move, with why.
type DrainFailures []DrainFailure

// DrainFailure is one VM a drain could not move.
type DrainFailure struct {
	VM     string `json:"vm"`
	Reason string `json:"reason"`
}

// StartDrain marks host name draining, owned by replica owner, with total
// VMs to move: from then on no reservation takes it. A host that drains
// already keeps its progress and gets the new owner. ErrLastHost when no
// other host in service is alive, schedulable and not draining (the
// condition is part of the UPDATE); ErrNotFound for no such host;
// ErrHostRetired for a retired one.
func (s *Store) StartDrain(ctx context.Context, name, owner string, total int64) (Host, error) {
	t := now()
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET
		drain_total = CASE WHEN drain_state = ? THEN drain_total ELSE ? END,
		drain_moved = CASE WHEN drain_state = ? THEN drain_moved ELSE 0 END,
		drain_failed = CASE WHEN drain_state = ? THEN drain_failed ELSE '[]' END,
		drain_started_at = CASE WHEN drain_state = ? THEN drain_started_at ELSE ? END,
		drain_state = ?, drain_owner = ?, updated_at = ?
		WHERE name = ? AND retired_at IS NULL AND EXISTS (SELECT 1 FROM hosts o
			WHERE o.name <> ? AND o.alive AND o.schedulable AND o.drain_state = '' AND o.retired_at IS NULL)`,
		DrainDraining, total, DrainDraining, DrainDraining, DrainDraining, t,
		DrainDraining, owner, t, name, name)
	if res.Error != nil {
		return Host{}, fmt.Errorf("start drain of host %s: %w", name, res.Error)
	}
	h, err := s.GetHost(ctx, name)
	if err != nil {
		return Host{}, err
	}
	if res.RowsAffected == 0 {
		if h.RetiredAt != nil {
			return Host{}, fmt.Errorf("drain host %s: %w", name, ErrHostRetired)
		}
		return Host{}, fmt.Errorf("drain host %s: %w", name, ErrLastHost)
	}
	return h, nil
}

// SetDrainProgress records how far host name's drain is, and its state,
// only while replica owner runs it and it has not been undrained; false
// when it no longer does.
func (s *Store) SetDrainProgress(ctx context.Context, name, owner, state string, moved int64, failed DrainFailures) (bool, error) {
	if failed == nil {
		failed = DrainFailures{}
	}
	text, err := jsonText(failed)
	if err != nil {
		return false, err
	}
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET drain_state = ?, drain_moved = ?, drain_failed = ?, updated_at = ?
		WHERE name = ? AND drain_owner = ? AND drain_state = ?`, state, moved, text, now(), name, owner, DrainDraining)
	if res.Error != nil {
		return false, fmt.Errorf("record drain of host %s: %w", name, res.Error)
	}
	return res.RowsAffected == 1, nil
}

// Undrain puts host name back in service: it takes VMs again and a drain
// pass that runs stops at its next step.
func (s *Store) Undrain(ctx context.Context, name string) (Host, error) {
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET drain_state = '', drain_owner = NULL, updated_at = ? WHERE name = ?`, now(), name)
	if res.Error != nil {
		return Host{}, fmt.Errorf("undrain host %s: %w", name, res.Error)
	}
	return s.GetHost(ctx, name)
}

// TakeDrain makes replica `to` the runner of host name's drain if its
// runner is still `from`.
func (s *Store) TakeDrain(ctx context.Context, name string, from *string, to string) (bool, error) {
	q := "UPDATE hosts SET drain_owner = ? WHERE name = ? AND drain_state = ? AND drain_owner = ?"
	args := []any{to, name, DrainDraining, from}
	if from == nil {
		q = "UPDATE hosts SET drain_owner = ? WHERE name = ? AND drain_state = ? AND drain_owner IS NULL"
		args = args[:3]
	}
	res := s.db.WithContext(ctx).Exec(q, args...)
	if res.Error != nil {
		return false, fmt.Errorf("take over drain of host %s: %w", name, res.Error)
	}
	return res.RowsAffected == 1, nil
}
