// Package httpclient is the one HTTP client core under the control API
// client (internal/client) and the agent client (internal/agentapi). It
// builds JSON requests, sends them under a retry policy with a timeout per
// attempt, and hands every failure to the client's own translation, so each
// client keeps only its routes, its policy and its typed errors.
//
// go-retryablehttp was the model; it is not used because its policy does
// not fit these clients: a timeout per attempt that differs per call (an
// agent create waits minutes, a read seconds), a wait for a request in
// flight on the server that does not use up retries, and attempts that
// timed out that must not be sent again.
package httpclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

// Policy says which failed attempts are sent again and when.
type Policy struct {
	// Retries is how many times a retryable failure is sent again.
	Retries int
	// Backoff is the wait before the n-th retry (n from 1), counting the
	// waits of patient retries too.
	Backoff func(n int) time.Duration
	// Retryable says whether a failed attempt may be sent again.
	Retryable func(err error) bool
	// Patient (optional) picks retryable failures that are retried until
	// the caller's context ends without using up Retries: a request still
	// in flight on the server. Only a client with Retries > 0 waits.
	Patient func(call *Call, err error) bool
}

// Errors turns what went wrong into the client's typed errors.
type Errors struct {
	// Transport is an attempt with no answer: err from the HTTP client;
	// timedOut when the attempt's own timeout (or the caller's deadline)
	// passed first.
	Transport func(call *Call, base string, err error, timedOut bool) error
	// Decode is an answer that is not the JSON the call asked for.
	Decode func(call *Call, base string, err error) error
	// Answer is an answer with a status of 300 or more, with the first
	// MaxErrorBody bytes of its body.
	Answer func(call *Call, base string, status int, body []byte) error
	// MaxErrorBody bounds what is read of an error answer.
	MaxErrorBody int64
	// MaxAnswer bounds a JSON answer; 0 reads it whole.
	MaxAnswer int64
}

// MaxTextAnswer bounds a text answer (Call.Out a *string).
const MaxTextAnswer = 2 << 20

// Core sends calls to one endpoint.
type Core struct {
	base   string
	token  string
	HTTP   *http.Client
	Policy Policy
	Errors Errors
	// TimingPrefix, when set, folds the Server-Timing steps of an answer
	// into the timing.Recorder of the call's context, each name prefixed:
	// the caller's own request then shows the steps of the calls it made.
	TimingPrefix string
	// Header, when set, is sent with every request (the agent client's
	// version headers).
	Header http.Header
}

// New returns a core for endpoint (a URL or host:port, http by default)
// that sends token as a bearer token when it is not empty.
func New(endpoint, token string, policy Policy, errs Errors) *Core {
	base := endpoint
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	return &Core{base: strings.TrimRight(base, "/"), token: token, HTTP: &http.Client{},
		Policy: policy, Errors: errs}
}

// Base is the endpoint's base URL.
func (c *Core) Base() string { return c.base }

// Call is one request of a client.
type Call struct {
	Method string
	Path   string // with its query, below the base URL
	In     any    // sent as JSON when not nil
	// Out receives the answer when not nil: a *string its text (at most
	// MaxTextAnswer bytes), anything else its JSON.
	Out any
	// Op names the call in errors; Method + " " + Path when empty.
	Op string
	// IdempotencyKey is sent as the Idempotency-Key header of every attempt.
	IdempotencyKey string
	// Timeout bounds one attempt (answer body included).
	Timeout time.Duration
	// NoRetry sends the call once whatever the policy says.
	NoRetry bool
	// Anonymous leaves out the bearer token.
	Anonymous bool
}

// Name is how errors name the call.
func (call *Call) Name() string {
	if call.Op != "" {
		return call.Op
	}
	return call.Method + " " + call.Path
}

// Do sends the call under the policy and decodes its answer into call.Out.
func (c *Core) Do(ctx context.Context, call *Call) error {
	var body []byte
	if call.In != nil {
		b, err := json.Marshal(call.In)
		if err != nil {
			return fmt.Errorf("%s: encode request: %w", call.Name(), err)
		}
		body = b
	}
	p := c.Policy
	waits := 0
	for attempt := 0; ; attempt++ {
		err := c.once(ctx, call, body)
		if err == nil || call.NoRetry || p.Retryable == nil || !p.Retryable(err) {
			return err
		}
		if ctx.Err() != nil {
			return errors.Join(err, ctx.Err())
		}
		patient := p.Retries > 0 && p.Patient != nil && p.Patient(call, err)
		if !patient && attempt >= p.Retries {
			return err
		}
		if patient {
			attempt--
		}
		waits++
		var wait time.Duration
		if p.Backoff != nil {
			wait = p.Backoff(waits)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
}

// NewRequest builds a request of the call with its headers.
func (c *Core) NewRequest(ctx context.Context, call *Call, body []byte) (*http.Request, error) {
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, call.Method, c.base+call.Path, r)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", call.Name(), err)
	}
	for name, values := range c.Header {
		req.Header[name] = values
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" && !call.Anonymous {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if call.IdempotencyKey != "" {
		req.Header.Set("Idempotency-Key", call.IdempotencyKey)
	}
	return req, nil
}

func (c *Core) once(ctx context.Context, call *Call, body []byte) error {
	if call.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, call.Timeout)
		defer cancel()
	}
	resp, err := c.send(ctx, call, body)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	if rec := timing.FromContext(ctx); rec != nil && c.TimingPrefix != "" {
		for _, st := range timing.Parse(resp.Header.Get("Server-Timing")) {
			rec.Add(c.TimingPrefix+st.Name, st.Duration)
		}
	}
	if call.Out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if text, ok := call.Out.(*string); ok {
		// A text answer (a console log): read as it is, bounded.
		b, err := io.ReadAll(io.LimitReader(resp.Body, MaxTextAnswer))
		if err != nil {
			return c.Errors.Decode(call, c.base, err)
		}
		*text = string(b)
		return nil
	}
	var r io.Reader = resp.Body
	if c.Errors.MaxAnswer > 0 {
		r = io.LimitReader(r, c.Errors.MaxAnswer)
	}
	if err := json.NewDecoder(r).Decode(call.Out); err != nil {
		return c.Errors.Decode(call, c.base, err)
	}
	return nil
}

// send makes one attempt and turns a failure or an error answer into the
// client's error; a successful answer's body is the caller's to close.
func (c *Core) send(ctx context.Context, call *Call, body []byte) (*http.Response, error) {
	req, err := c.NewRequest(ctx, call, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, c.Errors.Transport(call, c.base, err, errors.Is(ctx.Err(), context.DeadlineExceeded))
	}
	if resp.StatusCode >= 300 {
		defer func() { _ = resp.Body.Close() }()
		return nil, c.AnswerError(call, resp)
	}
	return resp, nil
}

// AnswerError reads the start of an error answer and hands it to the
// client's translation.
func (c *Core) AnswerError(call *Call, resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, c.Errors.MaxErrorBody))
	return c.Errors.Answer(call, c.base, resp.StatusCode, b)
}

// Sentinels that the typed errors of both clients unwrap to, for the
// answers that mean the same whichever server gave them.
var (
	ErrNotFound = errors.New("not found")
	ErrConflict = errors.New("conflict")
	ErrInvalid  = errors.New("invalid request")
)

// ByStatus is the sentinel of an error answer by its status alone: 404 not
// found, 409 conflict, any other 4xx invalid, anything else unavailable.
func ByStatus(status int, unavailable error) error {
	switch {
	case status == http.StatusNotFound:
		return ErrNotFound
	case status == http.StatusConflict:
		return ErrConflict
	case status >= 400 && status < 500:
		return ErrInvalid
	default:
		return unavailable
	}
}
