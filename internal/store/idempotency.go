package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// IdempotencyRecord is a row of idempotency_keys.
type IdempotencyRecord struct {
	Scope string `gorm:"column:scope;primaryKey"`
	// Caller is who sent the key (the token id, or "bootstrap"): keys of
	// different callers never meet.
	Caller      string `gorm:"column:caller;primaryKey"`
	Key         string `gorm:"column:idem_key;primaryKey"`
	RequestHash string `gorm:"column:request_hash"`
	// Status is the stored HTTP status; 0 while the first request is in flight.
	Status     int       `gorm:"column:status"`
	Response   string    `gorm:"column:response"`
	LeaseUntil int64     `gorm:"column:lease_until"`
	ExpiresAt  int64     `gorm:"column:expires_at"`
	CreatedAt  time.Time `gorm:"column:created_at"`
}

// TableName is the table of IdempotencyRecord.
func (IdempotencyRecord) TableName() string { return "idempotency_keys" }

// InFlight says whether the first request with this key has not finished.
func (r IdempotencyRecord) InFlight() bool { return r.Status == 0 }

// ClaimIdempotencyKey starts a request of caller under a key. claimed is true when
// this caller owns the key now: the key was new, had expired, or its first
// request was abandoned (in flight past its lease, e.g. a replica died)
// with the same request hash. Otherwise the existing record is returned
// for the caller to replay or refuse.
func (s *Store) ClaimIdempotencyKey(ctx context.Context, scope, caller, key, requestHash string, lease, ttl time.Duration) (IdempotencyRecord, bool, error) {
	t := now()
	rec := IdempotencyRecord{
		Scope: scope, Caller: caller, Key: key, RequestHash: requestHash,
		LeaseUntil: t.Add(lease).UnixMilli(), ExpiresAt: t.Add(ttl).UnixMilli(), CreatedAt: t,
	}
	db := s.db.WithContext(ctx)
	res := db.Clauses(clause.OnConflict{DoNothing: true}).Create(&rec)
	if res.Error != nil {
		return IdempotencyRecord{}, false, fmt.Errorf("claim idempotency key: %w", res.Error)
	}
	if res.RowsAffected == 1 {
		return rec, true, nil
	}
	var existing IdempotencyRecord
	err := db.Where("scope = ? AND caller = ? AND idem_key = ?", scope, caller, key).Take(&existing).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		// Deleted between our insert and read: the caller retries.
		return IdempotencyRecord{}, false, fmt.Errorf("claim idempotency key: it was released meanwhile, retry")
	}
	if err != nil {
		return IdempotencyRecord{}, false, fmt.Errorf("read idempotency key: %w", err)
	}
	nowMS := t.UnixMilli()
	expired := existing.ExpiresAt < nowMS
	abandoned := existing.InFlight() && existing.LeaseUntil < nowMS && existing.RequestHash == requestHash
	if !expired && !abandoned {
		return existing, false, nil
	}
	// Take it over; the conditions make only one of several callers win.
	res = db.Exec(`UPDATE idempotency_keys SET request_hash = ?, status = 0, response = '',
		lease_until = ?, expires_at = ?, created_at = ?
		WHERE scope = ? AND caller = ? AND idem_key = ? AND (expires_at < ? OR (status = 0 AND lease_until < ?))`,
		requestHash, rec.LeaseUntil, rec.ExpiresAt, t, scope, caller, key, nowMS, nowMS)
	if res.Error != nil {
		return IdempotencyRecord{}, false, fmt.Errorf("take over idempotency key: %w", res.Error)
	}
	if res.RowsAffected == 1 {
		return rec, true, nil
	}
	err = db.Where("scope = ? AND caller = ? AND idem_key = ?", scope, caller, key).Take(&existing).Error
	if err != nil {
		return IdempotencyRecord{}, false, fmt.Errorf("read idempotency key: %w", err)
	}
	return existing, false, nil
}

// CompleteIdempotencyKey stores the response of the request that owns the key.
func (s *Store) CompleteIdempotencyKey(ctx context.Context, scope, caller, key string, status int, response string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE idempotency_keys SET status = ?, response = ?
		WHERE scope = ? AND caller = ? AND idem_key = ? AND status = 0`, status, response, scope, caller, key)
	if res.Error != nil {
		return fmt.Errorf("store idempotent response: %w", res.Error)
	}
	return nil
}

// ReleaseIdempotencyKey forgets a key whose request failed, so that a
// retry runs it again.
func (s *Store) ReleaseIdempotencyKey(ctx context.Context, scope, caller, key string) error {
	res := s.db.WithContext(ctx).Exec("DELETE FROM idempotency_keys WHERE scope = ? AND caller = ? AND idem_key = ? AND status = 0", scope, caller, key)
	if res.Error != nil {
		return fmt.Errorf("release idempotency key: %w", res.Error)
	}
	return nil
}

// DeleteExpiredIdempotencyKeys removes keys past their expiry.
func (s *Store) DeleteExpiredIdempotencyKeys(ctx context.Context) (int64, error) {
	res := s.db.WithContext(ctx).Exec("DELETE FROM idempotency_keys WHERE expires_at < ?", now().UnixMilli())
	if res.Error != nil {
		return 0, fmt.Errorf("delete expired idempotency keys: %w", res.Error)
	}
	return res.RowsAffected, nil
}
