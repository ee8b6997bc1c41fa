package control

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

const maxIdempotencyKeyLen = 255

// BootstrapCaller is the caller of the bootstrap token (--token), and of
// calls made in process without one, for Idempotency-Keys.
const BootstrapCaller = "bootstrap"

type callerKey struct{}

// WithCaller returns ctx carrying who sends the request (Principal.Caller):
// Idempotency-Keys are kept per caller, so one caller's key never replays
// or blocks another caller's request.
func WithCaller(ctx context.Context, caller string) context.Context {
	return context.WithValue(ctx, callerKey{}, caller)
}

// callerOf is the caller WithCaller put in ctx, else BootstrapCaller.
func callerOf(ctx context.Context) string {
	if c, _ := ctx.Value(callerKey{}).(string); c != "" {
		return c
	}
	return BootstrapCaller
}

// idempotent runs a create under an Idempotency-Key (IETF draft semantics):
// the same caller, key and body replays the stored response, a different
// body is 422, and a retry while the first request runs is 409. Keys of
// different callers (callerOf) are unrelated. The key row in the database
// (primary key on scope, caller and key) is what makes this hold across
// replicas. Only successes are stored: a failed create leaves nothing
// behind (its cleanup chain ran), so the key is released for a retry.
func idempotent[T any](ctx context.Context, s *Service, scope, key string, req any, run func(context.Context) (T, error)) (T, error) {
	var zero T
	if len(key) > maxIdempotencyKeyLen {
		return zero, invalidf("Idempotency-Key is longer than %d characters", maxIdempotencyKeyLen)
	}
	body, err := json.Marshal(req)
	if err != nil {
		return zero, internal(err, "encode request for its idempotency key")
	}
	sum := sha256.Sum256(body)
	hash := hex.EncodeToString(sum[:])
	caller := callerOf(ctx)
	step := time.Now()
	rec, claimed, err := s.store.ClaimIdempotencyKey(ctx, scope, caller, key, hash, idempotencyLease, s.opts.IdempotencyTTL)
	timing.Since(ctx, "idempotency-claim", step)
	if err != nil {
		return zero, internal(err, "claim idempotency key")
	}
	if !claimed {
		switch {
		case rec.RequestHash != hash:
			return zero, &Error{Code: api.CodeIdempotencyMismatch,
				Message: "Idempotency-Key " + key + " was used with a different request body; use a new key for a new request"}
		case rec.InFlight():
			return zero, &Error{Code: api.CodeInFlight,
				Message: "a request with Idempotency-Key " + key + " is still in progress; retry shortly"}
		}
		var out T
		if err := json.Unmarshal([]byte(rec.Response), &out); err != nil {
			return zero, internal(err, "decode stored response of idempotency key "+key)
		}
		return out, nil
	}
	out, runErr := run(ctx)
	// The outcome is recorded even when the client went away meanwhile.
	bg, cancel := detached(ctx, idempotencyLease)
	defer cancel()
	if runErr != nil {
		if err := s.store.ReleaseIdempotencyKey(bg, scope, caller, key); err != nil {
			s.log.Error("release idempotency key after a failed request", "key", key, "err", err)
		}
		return zero, runErr
	}
	step = time.Now()
	resp, err := json.Marshal(out)
	if err == nil {
		err = s.store.CompleteIdempotencyKey(bg, scope, caller, key, http.StatusCreated, string(resp))
	}
	timing.Since(ctx, "idempotency-complete", step)
	if err != nil {
		// The create succeeded; a retry finds the key in flight until its
		// lease ends, then the unique name stops a second VM.
		s.log.Error("store idempotent response", "key", key, "err", err)
	}
	return out, nil
}
