package store

import (
	"context"
	"fmt"
	"time"
)

// RevokeUISession records that fleet page session id ended (signed out);
// the row lasts until the session would have expired.
func (s *Store) RevokeUISession(ctx context.Context, id string, expires time.Time) error {
	res := s.db.WithContext(ctx).Exec(
		"INSERT INTO ui_session_revocations (session_id, expires_at) VALUES (?, ?) ON CONFLICT (session_id) DO NOTHING",
		id, expires.UnixMilli())
	if res.Error != nil {
		return fmt.Errorf("revoke fleet page session: %w", res.Error)
	}
	return nil
}

// UISessionRevoked says whether fleet page session id signed out.
func (s *Store) UISessionRevoked(ctx context.Context, id string) (bool, error) {
	var n int64
	err := s.db.WithContext(ctx).Raw("SELECT COUNT(*) FROM ui_session_revocations WHERE session_id = ?", id).Scan(&n).Error
	if err != nil {
		return false, fmt.Errorf("read fleet page session revocations: %w", err)
	}
	return n > 0, nil
}

// DeleteExpiredUISessionRevocations forgets revocations of sessions that
// have expired by themselves.
func (s *Store) DeleteExpiredUISessionRevocations(ctx context.Context) (int64, error) {
	res := s.db.WithContext(ctx).Exec("DELETE FROM ui_session_revocations WHERE expires_at < ?", now().UnixMilli())
	if res.Error != nil {
		return 0, fmt.Errorf("delete expired fleet page session revocations: %w", res.Error)
	}
	return res.RowsAffected, nil
}
