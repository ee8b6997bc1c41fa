package control

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// sameForkRequest checks that a POST /v1/forks with Idempotency-Key key
// asks for the fork f that an earlier request with that key made. After a
// failed pass the key itself is released (only successes are stored), so
// the fork row is what still ties the key to its request: another body is
// 422 idempotency_mismatch, never a resume of f under a request it did not
// come from. Count is compared as f has it now: after a PATCH of the count
// the original body no longer describes the fork either.
func sameForkRequest(f store.Fork, in api.ForkCreate, key string) error {
	var diff string
	switch {
	case f.SourceVMID != in.SourceVMID:
		diff = fmt.Sprintf("source_vm_id %s, not %s", f.SourceVMID, in.SourceVMID)
	case f.Count != in.Count:
		diff = fmt.Sprintf("count %d, not %d", f.Count, in.Count)
	case f.PauseSource != in.PauseSource:
		diff = fmt.Sprintf("pause_source %v, not %v", f.PauseSource, in.PauseSource)
	case f.Placement != in.Placement:
		diff = fmt.Sprintf("placement %s, not %s", f.Placement, in.Placement)
	case f.Constraints != constraintsText(in.Constraints):
		diff = "other constraints"
	default:
		return nil
	}
	return &Error{Code: api.CodeIdempotencyMismatch, Message: fmt.Sprintf(
		"Idempotency-Key %s already made fork %s with %s; use a new key for a new request (or DELETE /v1/forks/%s first)",
		key, f.ID, diff, f.ID), Details: map[string]any{"fork_id": f.ID}}
}

// nameInFlightFork adds details.fork_id to a 409 in_flight of a fork create
// once the first request has recorded its fork: a client that must give up
// waiting can still keep track of (and later delete) what it started.
func (s *Service) nameInFlightFork(ctx context.Context, err error, key string) error {
	var e *Error
	if !errors.As(err, &e) || e.Code != api.CodeInFlight {
		return err
	}
	f, gerr := s.store.GetForkByIdempotencyKey(ctx, callerOf(ctx), key)
	if gerr != nil {
		return err
	}
	if e.Details == nil {
		e.Details = map[string]any{}
	}
	e.Details["fork_id"] = f.ID
	e.Message += fmt.Sprintf(" (fork %s)", f.ID)
	return err
}
