// Package client is the typed Go client of the control API. The provider,
// tests and benchmarks use it; it maps HTTP answers to the errors below once.
package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpclient"
)

// Errors a caller can test with errors.Is.
var (
	ErrNotFound   = httpclient.ErrNotFound
	ErrConflict   = httpclient.ErrConflict
	ErrNoCapacity = errors.New("no capacity")
	ErrNoAddress  = errors.New("no free address on the network")
	// ErrQuotaExceeded: the request would take a project past one of its
	// quotas (409 quota_exceeded); QuotaExceededOf reads which. It is not
	// ErrConflict: nothing holds a name, the project needs a larger quota.
	ErrQuotaExceeded = errors.New("project quota exceeded")
	ErrInvalid       = httpclient.ErrInvalid
	ErrUnauthorized  = errors.New("unauthorized")
	// ErrForbidden: the token is valid but its scopes do not allow the call.
	ErrForbidden           = errors.New("forbidden: the token's scopes do not allow this")
	ErrIdempotencyMismatch = errors.New("idempotency key reused with a different body")
	ErrInFlight            = errors.New("request with this idempotency key is in flight")
	ErrUnavailable         = errors.New("control API unavailable")
	// ErrUnexpectedAnswer is a 404 that is not the control API's own
	// not_found error (a route miss behind a wrong path prefix, a proxy's
	// error page): the object may well exist, so it is never ErrNotFound.
	ErrUnexpectedAnswer = errors.New("the endpoint answered 404 without the control API's not_found error")
)

// Error is an error answer of the control API.
type Error struct {
	Status  int
	Code    string
	Message string
	Details map[string]any
}

func (e *Error) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("%d %s", e.Status, e.Code)
	}
	return fmt.Sprintf("%s (%d %s)", e.Message, e.Status, e.Code)
}

// Unwrap maps the error code (or status) to the package's sentinel errors.
func (e *Error) Unwrap() error {
	switch e.Code {
	case api.CodeNoCapacity:
		return ErrNoCapacity
	case api.CodeNoAddress:
		return ErrNoAddress
	case api.CodeQuotaExceeded:
		return ErrQuotaExceeded
	case api.CodeIdempotencyMismatch:
		return ErrIdempotencyMismatch
	case api.CodeInFlight:
		return ErrInFlight
	}
	switch {
	case e.Status == http.StatusNotFound && e.Code == api.CodeNotFound:
		return ErrNotFound
	case e.Status == http.StatusNotFound:
		return ErrUnexpectedAnswer
	case e.Status == http.StatusUnauthorized:
		return ErrUnauthorized
	case e.Status == http.StatusForbidden:
		return ErrForbidden
	case e.Status == http.StatusUnprocessableEntity && e.Code == "":
		return ErrIdempotencyMismatch
	}
	return httpclient.ByStatus(e.Status, ErrUnavailable)
}

// Client talks to one control API endpoint.
type Client struct {
	core    *httpclient.Core
	timeout time.Duration
	backoff time.Duration
}

// Option configures a Client.
type Option func(*Client)

// WithHTTPClient sets the HTTP client (TLS settings, a counting transport).
func WithHTTPClient(h *http.Client) Option { return func(c *Client) { c.core.HTTP = h } }

// WithTimeout sets the timeout of one attempt (default 2 minutes: creates
// wait for a VM to boot).
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// WithRetries sets how often a retryable failure is retried (default 4) and
// the first backoff (default 250 ms, doubling).
func WithRetries(n int, backoff time.Duration) Option {
	return func(c *Client) { c.core.Policy.Retries, c.backoff = n, backoff }
}

// New returns a client of the control API at endpoint (a URL or host:port).
func New(endpoint, token string, opts ...Option) *Client {
	c := &Client{timeout: 2 * time.Minute, backoff: 250 * time.Millisecond}
	c.core = httpclient.New(endpoint, token, httpclient.Policy{
		Retries:   4,
		Backoff:   c.backoffOf,
		Retryable: retryable,
		Patient:   inFlightOnOwnKey,
	}, httpclient.Errors{
		Transport:    transportError,
		Decode:       decodeAnswerError,
		Answer:       answerError,
		MaxErrorBody: 1 << 20,
	})
	for _, o := range opts {
		o(c)
	}
	return c
}

// Endpoint is the base URL the client talks to.
func (c *Client) Endpoint() string { return c.core.Base() }

// NewIdempotencyKey returns a random key for one logical create.
func NewIdempotencyKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// PutHost registers or updates a host.
func (c *Client) PutHost(ctx context.Context, name string, in api.HostPut) (api.Host, error) {
	var out api.Host
	err := c.call(ctx, http.MethodPut, "/v1/hosts/"+url.PathEscape(name), in, &out, "", true)
	return out, err
}

// GetHost returns one host.
func (c *Client) GetHost(ctx context.Context, name string) (api.Host, error) {
	var out api.Host
	err := c.call(ctx, http.MethodGet, "/v1/hosts/"+url.PathEscape(name), nil, &out, "", true)
	return out, err
}

// ListHosts returns one page of hosts.
func (c *Client) ListHosts(ctx context.Context, opts ListOptions) (api.List[api.Host], error) {
	var out api.List[api.Host]
	err := c.call(ctx, http.MethodGet, "/v1/hosts"+opts.query(), nil, &out, "", true)
	return out, err
}

// AllHosts returns every host, following pages.
func (c *Client) AllHosts(ctx context.Context) ([]api.Host, error) {
	return all(ctx, func(ctx context.Context, token string) (api.List[api.Host], error) {
		return c.ListHosts(ctx, ListOptions{PageSize: api.MaxPageSize, PageToken: token})
	})
}

// DeleteHost deregisters a host; ErrConflict while VMs are placed there.
func (c *Client) DeleteHost(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/hosts/"+url.PathEscape(name), nil, nil, "", true)
}

// RetireHost retires a host whose agent is gone for good: its VMs are
// marked lost and their capacity released. Retrying is safe.
func (c *Client) RetireHost(ctx context.Context, name string) (api.Host, error) {
	var out api.Host
	err := c.call(ctx, http.MethodPost, "/v1/hosts/"+url.PathEscape(name)+"/retire", nil, &out, "", true)
	return out, err
}

// CreateVM creates a VM. Every retry of this call sends the same
// idempotencyKey, so a lost answer never makes a second VM. An empty key
// gets a fresh random one.
func (c *Client) CreateVM(ctx context.Context, in api.VMCreate, idempotencyKey string) (api.VM, error) {
	if idempotencyKey == "" {
		idempotencyKey = NewIdempotencyKey()
	}
	var out api.VM
	err := c.call(ctx, http.MethodPost, "/v1/vms", in, &out, idempotencyKey, true)
	return out, err
}

// GetVM returns one VM.
func (c *Client) GetVM(ctx context.Context, id string) (api.VM, error) {
	var out api.VM
	err := c.call(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id), nil, &out, "", true)
	return out, err
}

// VMConsole returns the last n bytes of a VM's serial console (n 0: the
// server's default, 64 KiB; at most 1 MiB), read from its host's agent.
func (c *Client) VMConsole(ctx context.Context, id string, n int64) (string, error) {
	path := "/v1/vms/" + url.PathEscape(id) + "/console"
	if n > 0 {
		path += "?bytes=" + strconv.FormatInt(n, 10)
	}
	var out string
	err := c.call(ctx, http.MethodGet, path, nil, &out, "", true)
	return out, err
}

// VMGuest returns what a VM's guest reported on its console during its
// current boot: cloud-init's state, its addresses, and (busybox guests)
// the hostname and user-data digest it read from its seed.
func (c *Client) VMGuest(ctx context.Context, id string) (api.GuestStatus, error) {
	var out api.GuestStatus
	err := c.call(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id)+"/guest", nil, &out, "", true)
	return out, err
}

// ListOptions filter and page a list.
type ListOptions struct {
	PageSize  int
	PageToken string
	Host      string
	Name      string
	Label     string // key=value
	ForkID    string
}

func (o ListOptions) query() string {
	q := url.Values{}
	if o.PageSize > 0 {
		q.Set("page_size", strconv.Itoa(o.PageSize))
	}
	for k, v := range map[string]string{"page_token": o.PageToken, "host": o.Host, "name": o.Name, "label": o.Label, "fork_id": o.ForkID} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if len(q) == 0 {
		return ""
	}
	return "?" + q.Encode()
}

// ListVMs returns one page of VMs.
func (c *Client) ListVMs(ctx context.Context, opts ListOptions) (api.List[api.VM], error) {
	var out api.List[api.VM]
	err := c.call(ctx, http.MethodGet, "/v1/vms"+opts.query(), nil, &out, "", true)
	return out, err
}

// AllVMs returns every VM that matches opts, following pages.
func (c *Client) AllVMs(ctx context.Context, opts ListOptions) ([]api.VM, error) {
	return all(ctx, func(ctx context.Context, token string) (api.List[api.VM], error) {
		o := opts
		if o.PageSize == 0 {
			o.PageSize = api.MaxPageSize
		}
		o.PageToken = token
		return c.ListVMs(ctx, o)
	})
}

// UpdateVM changes power state or labels in place.
func (c *Client) UpdateVM(ctx context.Context, id string, in api.VMPatch) (api.VM, error) {
	var out api.VM
	err := c.call(ctx, http.MethodPatch, "/v1/vms/"+url.PathEscape(id), in, &out, "", true)
	return out, err
}

// DeleteVM deletes a VM; deleting a VM that is gone succeeds on the server.
func (c *Client) DeleteVM(ctx context.Context, id string) error {
	return c.call(ctx, http.MethodDelete, "/v1/vms/"+url.PathEscape(id), nil, nil, "", true)
}

// Place asks where a VM of this shape would go, reserving nothing.
func (c *Client) Place(ctx context.Context, in api.PlacementRequest) (api.PlacementResult, error) {
	var out api.PlacementResult
	err := c.call(ctx, http.MethodPost, "/v1/placements", in, &out, "", true)
	return out, err
}

// CreateFork forks a running VM, idempotent on the key like CreateVM.
func (c *Client) CreateFork(ctx context.Context, in api.ForkCreate, idempotencyKey string) (api.Fork, error) {
	if idempotencyKey == "" {
		idempotencyKey = NewIdempotencyKey()
	}
	var out api.Fork
	err := c.call(ctx, http.MethodPost, "/v1/forks", in, &out, idempotencyKey, true)
	return out, err
}

// GetFork returns a fork and its children.
func (c *Client) GetFork(ctx context.Context, id string) (api.Fork, error) {
	var out api.Fork
	err := c.call(ctx, http.MethodGet, "/v1/forks/"+url.PathEscape(id), nil, &out, "", true)
	return out, err
}

// UpdateFork changes the number of children.
func (c *Client) UpdateFork(ctx context.Context, id string, in api.ForkPatch) (api.Fork, error) {
	var out api.Fork
	err := c.call(ctx, http.MethodPatch, "/v1/forks/"+url.PathEscape(id), in, &out, "", true)
	return out, err
}

// DeleteFork removes a fork, its children and its snapshot.
func (c *Client) DeleteFork(ctx context.Context, id string) error {
	return c.call(ctx, http.MethodDelete, "/v1/forks/"+url.PathEscape(id), nil, nil, "", true)
}

// CreateToken makes an API token; the answer's Secret is shown only here.
func (c *Client) CreateToken(ctx context.Context, in api.TokenCreate) (api.Token, error) {
	var out api.Token
	// Not retried: a lost answer would make a second token, and the secret
	// of the first would be lost anyway.
	err := c.call(ctx, http.MethodPost, "/v1/tokens", in, &out, "", false)
	return out, err
}

// ListTokens returns one page of tokens (without secrets).
func (c *Client) ListTokens(ctx context.Context, opts ListOptions) (api.List[api.Token], error) {
	var out api.List[api.Token]
	err := c.call(ctx, http.MethodGet, "/v1/tokens"+opts.query(), nil, &out, "", true)
	return out, err
}

// RevokeToken deletes a token; ErrNotFound when there is none with this id.
func (c *Client) RevokeToken(ctx context.Context, id string) error {
	return c.call(ctx, http.MethodDelete, "/v1/tokens/"+url.PathEscape(id), nil, nil, "", true)
}

func excerpt(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func all[T any](ctx context.Context, page func(context.Context, string) (api.List[T], error)) ([]T, error) {
	var items []T
	token := ""
	for {
		p, err := page(ctx, token)
		if err != nil {
			return nil, err
		}
		items = append(items, p.Items...)
		if p.NextPageToken == "" {
			return items, nil
		}
		token = p.NextPageToken
	}
}

// retryable says whether a failed attempt may be sent again. Every call of
// this client is safe to repeat: reads and PUT/PATCH/DELETE are idempotent,
// and POSTs carry an Idempotency-Key.
func retryable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrInFlight)
}

// inFlightOnOwnKey: 409 in_flight on the caller's own key means the first
// attempt is still running on the server (it outlived this client's
// per-attempt timeout). Failing now would leave what it makes outside the
// caller's hands, so the client waits it out until the caller's deadline
// without using up retries (a client made with no retries does not wait).
func inFlightOnOwnKey(call *httpclient.Call, err error) bool {
	return call.IdempotencyKey != "" && errors.Is(err, ErrInFlight)
}

// backoffOf is the wait before the n-th retry: the first backoff, doubling,
// at most maxInFlightPoll.
func (c *Client) backoffOf(n int) time.Duration {
	wait := c.backoff
	for i := 1; i < n && wait < maxInFlightPoll; i++ {
		wait *= 2
	}
	return min(wait, maxInFlightPoll)
}

func (c *Client) call(ctx context.Context, method, path string, in, out any, idemKey string, retry bool) error {
	return c.core.Do(ctx, &httpclient.Call{Method: method, Path: path, In: in, Out: out,
		IdempotencyKey: idemKey, Timeout: c.timeout, NoRetry: !retry})
}

// maxInFlightPoll caps the wait between polls of a request in flight.
const maxInFlightPoll = 5 * time.Second

// MayHaveCreated reports whether a failed create may nevertheless have made
// its object on the server: no definitive answer came back (the service was
// unavailable, an attempt timed out, the caller's deadline passed while the
// request was in flight). A caller that must give up then keeps what it can
// of the object rather than losing track of it.
func MayHaveCreated(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrInFlight) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

func transportError(call *httpclient.Call, base string, err error, _ bool) error {
	return fmt.Errorf("%s %s: %w: %v", call.Method, base+call.Path, ErrUnavailable, err)
}

func decodeAnswerError(call *httpclient.Call, _ string, err error) error {
	return fmt.Errorf("%s: decode answer: %w: %v", call.Name(), ErrUnavailable, err)
}

// answerError is an answer of status 300 or more as an *Error: the API's
// envelope, or for anything else (a proxy's page) a short excerpt, enough
// to recognise it.
func answerError(call *httpclient.Call, base string, status int, b []byte) error {
	e := &Error{Status: status}
	var env api.ErrorBody
	if json.Unmarshal(b, &env) == nil && env.Error.Code != "" {
		e.Code, e.Message, e.Details = env.Error.Code, env.Error.Message, env.Error.Details
		return e
	}
	e.Message = excerpt(strings.TrimSpace(string(b)), 200)
	if e.Status == http.StatusNotFound {
		e.Message = fmt.Sprintf("%s %s answered 404 without the control API's error envelope: %s", call.Method, base+call.Path, e.Message)
	}
	return e
}
