package agent

import (
	"fmt"
	"net/http"
)

// Error codes of the error envelope (the same words as the control API's).
const (
	CodeInvalid      = "invalid"
	CodeUnauthorized = "unauthorized"
	CodeForbidden    = "forbidden"
	CodeNotFound     = "not_found"
	CodeConflict     = "conflict"
	CodeTooLarge     = "too_large"
	CodeUnavailable  = "unavailable"
	CodeInternal     = "internal"
)

// Error is a domain error with the status and code it maps to; the HTTP
// layer translates it once, in its error handler.
type Error struct {
	Status  int
	Code    string
	Message string
	Details map[string]any
	Err     error // the cause, logged and never sent
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Message + ": " + e.Err.Error()
	}
	return e.Message
}

func (e *Error) Unwrap() error { return e.Err }

func errNotFound(id string) *Error {
	return &Error{Status: http.StatusNotFound, Code: CodeNotFound,
		Message: fmt.Sprintf("vm %s does not exist on this agent", id),
		Details: map[string]any{"id": id}}
}

func errInvalid(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Code: CodeInvalid, Message: fmt.Sprintf(format, args...)}
}

func errConflict(format string, args ...any) *Error {
	return &Error{Status: http.StatusConflict, Code: CodeConflict, Message: fmt.Sprintf(format, args...)}
}

// ErrInvalidSpec is what a driver's CheckSpec returns for a shape it cannot run.
func ErrInvalidSpec(format string, args ...any) error { return errInvalid(format, args...) }

// ErrNoBridge is what a driver's CheckSpec returns for a bridge-mode NIC
// whose bridge does not exist on this host.
func ErrNoBridge(bridge, host string) error {
	e := errInvalid("bridge %s does not exist on host %s: create it there first, or place the vm on a host that has it", bridge, host)
	e.Details = map[string]any{"bridge": bridge, "host": host}
	return e
}
