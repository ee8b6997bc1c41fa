package api

// Error codes of the error envelope.
const (
	CodeInvalid      = "invalid"
	CodeUnauthorized = "unauthorized"
	// CodeNotFound is the API's own answer for an object it does not have;
	// only this code means "gone" to a client.
	CodeNotFound = "not_found"
	// CodeNoRoute answers a path the API does not serve (404 too, but not
	// "the object is gone": a wrong endpoint or path prefix).
	CodeNoRoute    = "no_route"
	CodeConflict   = "conflict"
	CodeNoCapacity = "no_capacity"
	CodeNoAddress  = "no_address"
	// CodeQuotaExceeded is a request that would take a project past one
	// of its quotas (409); details: project, resource, limit, used,
	// requested.
	CodeQuotaExceeded       = "quota_exceeded"
	CodeForbidden           = "forbidden"
	CodeIdempotencyMismatch = "idempotency_mismatch"
	CodeInFlight            = "in_flight"
	CodeTooLarge            = "too_large"
	CodeUnavailable         = "unavailable"
	CodeInternal            = "internal"
	// CodeVersionSkew: the two kvmd processes of a call are outside the
	// version skew contract; the message names both versions.
	CodeVersionSkew = "version_skew"
)

// ErrorBody is the one error envelope of both APIs:
// {"error": {"code": "...", "message": "...", "details": {...}}}.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the content of the envelope.
type ErrorDetail struct {
	Code    string         `json:"code"`
	Message string         `json:"message"`
	Details map[string]any `json:"details,omitempty"`
}
