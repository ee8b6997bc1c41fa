package control

import (
	"context"
	"time"
)

// EndUISession ends fleet page session id (signed out) on every replica:
// its cookie, even a copy, no longer opens the page.
func (s *Service) EndUISession(ctx context.Context, id string, expires time.Time) error {
	if err := s.store.RevokeUISession(ctx, id, expires); err != nil {
		return fromStore(err, "end fleet page session")
	}
	return nil
}

// UISessionEnded says whether fleet page session id signed out.
func (s *Service) UISessionEnded(ctx context.Context, id string) (bool, error) {
	ended, err := s.store.UISessionRevoked(ctx, id)
	if err != nil {
		return false, fromStore(err, "check fleet page session")
	}
	return ended, nil
}
