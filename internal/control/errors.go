package control

import (
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Error is a domain error of a use case. Code is one of the api.Code*
// values; the HTTP layer maps it to a status in one place.
type Error struct {
	Code    string
	Message string
	Details map[string]any
	Err     error // the cause, for logs; never shown to clients
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Message + ": " + e.Err.Error()
	}
	return e.Message
}

func (e *Error) Unwrap() error { return e.Err }

func invalidf(format string, args ...any) *Error {
	return &Error{Code: api.CodeInvalid, Message: fmt.Sprintf(format, args...)}
}

func notFoundf(format string, args ...any) *Error {
	return &Error{Code: api.CodeNotFound, Message: fmt.Sprintf(format, args...)}
}

func conflictf(format string, args ...any) *Error {
	return &Error{Code: api.CodeConflict, Message: fmt.Sprintf(format, args...)}
}

func unavailable(cause error, format string, args ...any) *Error {
	return &Error{Code: api.CodeUnavailable, Message: fmt.Sprintf(format, args...), Err: cause}
}

// internal wraps an unexpected failure (usually the database).
func internal(cause error, what string) *Error {
	if store.IsUnavailable(cause) {
		return &Error{Code: api.CodeUnavailable, Message: what + ": the database does not answer; retry shortly", Err: cause}
	}
	return &Error{Code: api.CodeInternal, Message: what, Err: cause}
}

// fromStore turns a store error into a domain error once, at this boundary.
func fromStore(err error, what string) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	var qe *store.QuotaError
	switch {
	case errors.As(err, &qe):
		return quotaExceeded(qe)
	case errors.Is(err, store.ErrNotFound):
		return &Error{Code: api.CodeNotFound, Message: err.Error(), Err: err}
	case errors.Is(err, store.ErrDuplicateName), errors.Is(err, store.ErrHostInUse), errors.Is(err, store.ErrVolumeNotReady),
		errors.Is(err, store.ErrMigrating):
		return &Error{Code: api.CodeConflict, Message: err.Error(), Err: err}
	}
	return internal(err, what)
}

// fromAgent turns an agent call error into a domain error that says which
// host failed and what to do.
func fromAgent(err error, host, what string) error {
	var ae *agentapi.Error
	switch {
	case errors.As(err, &ae) && ae.Status == 401:
		return unavailable(err, "%s: the agent of host %s refused the agent token; check --agent-token on both sides", what, host)
	case errors.Is(err, agentapi.ErrNotFound):
		return &Error{Code: api.CodeNotFound, Message: fmt.Sprintf("%s: host %s does not have it", what, host), Err: err}
	case errors.Is(err, agentapi.ErrInvalid), errors.Is(err, agentapi.ErrConflict):
		msg := err.Error()
		if ae != nil {
			msg = ae.Message
		}
		return &Error{Code: api.CodeInvalid, Message: fmt.Sprintf("%s: host %s refused: %s", what, host, msg), Err: err}
	}
	if ae != nil { // it answered with a server error: its log has the cause
		return unavailable(err, "%s: the agent of host %s failed (%d %s); retry, and check that agent's log if it persists",
			what, host, ae.Status, ae.Code)
	}
	return unavailable(err, "%s: the agent of host %s did not answer; retry when it is back", what, host)
}
