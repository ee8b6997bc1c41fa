package control

import "context"

// RefreshHostView brings the host view up to date with the database, as
// the host monitor does after each round of syncs.
func (s *Service) RefreshHostView(ctx context.Context) error {
	return s.refreshView(ctx)
}

// ReloadHostView replaces the host view with every host of the database.
func (s *Service) ReloadHostView(ctx context.Context) error {
	return s.reloadView(ctx)
}
