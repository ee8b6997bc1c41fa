package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// Token is a row of tokens: an API token with its scopes. SecretSHA256 is
// the hex SHA-256 of the secret; the secret itself is never stored.
type Token struct {
	ID           string   `gorm:"column:id;primaryKey"`
	Name         string   `gorm:"column:name"`
	SecretSHA256 string   `gorm:"column:secret_sha256"`
	Scopes       []string `gorm:"column:scopes;serializer:json"`
	// Project is the project the token acts in; nil for a fleet-wide token.
	Project    *string    `gorm:"column:project"`
	ExpiresAt  *time.Time `gorm:"column:expires_at"`
	LastUsedAt *time.Time `gorm:"column:last_used_at"`
	CreatedAt  time.Time  `gorm:"column:created_at"`
}

// TableName is the table of Token.
func (Token) TableName() string { return "tokens" }

// InsertToken stores a new token.
func (s *Store) InsertToken(ctx context.Context, t Token) error {
	if t.CreatedAt.IsZero() {
		t.CreatedAt = now()
	}
	if err := s.db.WithContext(ctx).Create(&t).Error; err != nil {
		if isDuplicate(err) {
			return fmt.Errorf("token %s: %w", t.Name, ErrDuplicateName)
		}
		return fmt.Errorf("insert token %s: %w", t.Name, err)
	}
	return nil
}

// TokenBySecretHash returns the token whose secret has this hex SHA-256;
// ErrNotFound when none (unknown or revoked).
func (s *Store) TokenBySecretHash(ctx context.Context, sha256Hex string) (Token, error) {
	var t Token
	err := s.db.WithContext(ctx).Where("secret_sha256 = ?", sha256Hex).Take(&t).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Token{}, fmt.Errorf("token: %w", ErrNotFound)
	}
	if err != nil {
		return Token{}, fmt.Errorf("read token: %w", err)
	}
	return t, nil
}

// ListTokens returns up to limit tokens with ids after `after`, by id.
func (s *Store) ListTokens(ctx context.Context, after string, limit int) ([]Token, error) {
	var out []Token
	if err := keysetPage(s.db.WithContext(ctx), "id", after, limit).Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list tokens: %w", err)
	}
	return out, nil
}

// DeleteToken removes (revokes) a token and returns its row; ErrNotFound
// when there is no token with this id.
func (s *Store) DeleteToken(ctx context.Context, id string) (Token, error) {
	var t Token
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		if err := tx.Where("id = ?", id).Take(&t).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return fmt.Errorf("token %s: %w", id, ErrNotFound)
			}
			return fmt.Errorf("read token %s: %w", id, err)
		}
		if err := tx.Exec("DELETE FROM tokens WHERE id = ?", id).Error; err != nil {
			return fmt.Errorf("delete token %s: %w", id, err)
		}
		return nil
	})
	return t, err
}

// TouchToken records a use of a token at `at`, unless a use at or after
// `notBefore` is recorded already: replicas that see the same token in the
// same minute write it once between them.
func (s *Store) TouchToken(ctx context.Context, id string, at, notBefore time.Time) error {
	err := s.db.WithContext(ctx).Exec("UPDATE tokens SET last_used_at = ? WHERE id = ? AND (last_used_at IS NULL OR last_used_at < ?)",
		at.UTC(), id, notBefore.UTC()).Error
	if err != nil {
		return fmt.Errorf("record use of token %s: %w", id, err)
	}
	return nil
}
