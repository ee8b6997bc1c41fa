package agentapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/kvmfleet/terraform-provider-kvm/internal/httpclient"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// Errors a caller can test with errors.Is.
var (
	ErrNotFound    = httpclient.ErrNotFound
	ErrConflict    = httpclient.ErrConflict
	ErrInvalid     = httpclient.ErrInvalid
	ErrUnavailable = errors.New("agent unavailable")
	// ErrTimedOut (with ErrUnavailable) is an attempt that reached its
	// timeout: the agent may have the request and still be working on it,
	// so it is not sent again (that would only wait again).
	ErrTimedOut = errors.New("agent call timed out")
)

// OpBound is how long an agent may take to snapshot a VM or to pull a
// snapshot from a peer before it gives up (its own bound), plus a margin:
// the control plane's wait for those calls covers it.
const OpBound = 10*time.Minute + 30*time.Second

// Error is an error answer of an agent.
type Error struct {
	Status  int
	Code    string
	Message string
	Op      string
}

func (e *Error) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("agent %s: %d %s", e.Op, e.Status, e.Code)
	}
	return fmt.Sprintf("agent %s: %d %s: %s", e.Op, e.Status, e.Code, e.Message)
}

// Unwrap maps the HTTP status to the package's sentinel errors.
func (e *Error) Unwrap() error { return httpclient.ByStatus(e.Status, ErrUnavailable) }

// Client is a typed client of one host agent.
type Client struct {
	core    *httpclient.Core
	timeout time.Duration
}

// Option configures a Client.
type Option func(*Client)

// WithHTTPClient sets the HTTP client (for TLS settings or a test transport).
func WithHTTPClient(h *http.Client) Option { return func(c *Client) { c.core.HTTP = h } }

// WithTimeout sets the timeout of one attempt of a call (default 10 s).
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// WithRetries sets how many times a failed call is retried (default 2).
// Every agent call is idempotent, so a retry never creates a second thing.
func WithRetries(n int) Option { return func(c *Client) { c.core.Policy.Retries = n } }

// NewClient returns a client of the agent at address ("host:port" or a URL).
func NewClient(address, token string, opts ...Option) *Client {
	c := &Client{timeout: 10 * time.Second}
	c.core = httpclient.New(address, token, httpclient.Policy{
		Retries:   2,
		Backoff:   func(n int) time.Duration { return time.Duration(n*n) * 100 * time.Millisecond },
		Retryable: retryable,
	}, httpclient.Errors{
		Transport:    transportError,
		Decode:       decodeAnswerError,
		Answer:       answerError,
		MaxErrorBody: maxErrorBody,
		MaxAnswer:    maxAnswer,
	})
	c.core.TimingPrefix = "agent."
	// Every call says which kvmd makes it: an agent refuses a caller
	// outside its skew contract (internal/version) with both versions.
	c.core.Header = http.Header{}
	version.SetHeaders(c.core.Header)
	for _, o := range opts {
		o(c)
	}
	return c
}

// BaseURL is the agent's base URL.
func (c *Client) BaseURL() string { return c.core.Base() }

// Info returns the host's capacity, accel, driver and images.
func (c *Client) Info(ctx context.Context) (Info, error) {
	var out Info
	err := c.do(ctx, http.MethodGet, "/v1/info", nil, &out, c.timeout)
	return out, err
}

// Identity challenges the agent (POST /v1/identity) without sending the
// token: the answer is to be checked with VerifyIdentity before the token
// goes to this address.
func (c *Client) Identity(ctx context.Context, ch IdentityChallenge) (IdentityProof, error) {
	var out IdentityProof
	err := c.core.Do(ctx, &httpclient.Call{Method: http.MethodPost, Path: "/v1/identity", In: ch, Out: &out,
		Timeout: c.timeout, Anonymous: true})
	return out, err
}

// ListVMs returns every VM on the agent.
func (c *Client) ListVMs(ctx context.Context) ([]VM, error) {
	var out VMList
	err := c.do(ctx, http.MethodGet, "/v1/vms", nil, &out, c.timeout)
	return out.Items, err
}

// GetVM returns one VM; ErrNotFound when the agent does not have it.
func (c *Client) GetVM(ctx context.Context, id string) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id), nil, &out, c.timeout)
	return out, err
}

// CreateVM creates the VM with this id, or returns it if it exists.
// Booting can take a while under TCG, so the call gets a longer timeout.
func (c *Client) CreateVM(ctx context.Context, id string, spec VMSpec) (VM, error) {
	var out VM
	timeout := 6 * c.timeout
	if spec.Snapshot != nil {
		timeout = max(timeout, OpBound) // the agent may pull the snapshot first
	}
	err := c.do(ctx, http.MethodPut, "/v1/vms/"+url.PathEscape(id), spec, &out, timeout)
	return out, err
}

// DeleteVM destroys the VM and its files; deleting an unknown id succeeds.
func (c *Client) DeleteVM(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/vms/"+url.PathEscape(id), nil, nil, 3*c.timeout)
}

// Action runs a power action (start, stop, pause, resume) and returns the VM.
func (c *Client) Action(ctx context.Context, id, action string) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/"+action, nil, &out, 6*c.timeout)
	return out, err
}

// ResizeVM gives the VM a new shape (vCPUs, memory) and returns the VM as
// it is after the change. A running guest restarts, which under TCG takes
// a while, so the call gets the longer timeout of a create.
func (c *Client) ResizeVM(ctx context.Context, id string, shape VMShape) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPut, "/v1/vms/"+url.PathEscape(id)+"/shape", shape, &out, 6*c.timeout)
	return out, err
}

// Console returns the last part of the VM's serial console log (the
// agent's default length, 64 KiB).
func (c *Client) Console(ctx context.Context, id string) (string, error) {
	return c.ConsoleTail(ctx, id, 0)
}

// Guest returns what the VM's guest reported on its console during its
// current boot (cloud-init state, addresses, the busybox guest's seed
// digest).
func (c *Client) Guest(ctx context.Context, id string) (GuestStatus, error) {
	var out GuestStatus
	err := c.do(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id)+"/guest", nil, &out, c.timeout)
	return out, err
}

// ConsoleTail returns the last n bytes of the VM's serial console log (n
// 0: the agent's default, 64 KiB; at most 1 MiB).
func (c *Client) ConsoleTail(ctx context.Context, id string, n int64) (string, error) {
	path := "/v1/vms/" + url.PathEscape(id) + "/console"
	if n > 0 {
		path += "?bytes=" + strconv.FormatInt(n, 10)
	}
	req, err := c.newRequest(ctx, http.MethodGet, path, nil)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	resp, err := c.core.HTTP.Do(req.WithContext(ctx))
	if err != nil {
		return "", fmt.Errorf("agent console %s: %w: %v", id, ErrUnavailable, err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode >= 300 {
		return "", decodeError("console "+id, resp)
	}
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// CreateSnapshot takes the snapshot with this id, or returns it if it exists.
func (c *Client) CreateSnapshot(ctx context.Context, id string, spec SnapshotSpec) (Snapshot, error) {
	var out Snapshot
	err := c.do(ctx, http.MethodPut, "/v1/snapshots/"+url.PathEscape(id), spec, &out, max(6*c.timeout, OpBound))
	return out, err
}

// GetSnapshot returns a snapshot's metadata.
func (c *Client) GetSnapshot(ctx context.Context, id string) (Snapshot, error) {
	var out Snapshot
	err := c.do(ctx, http.MethodGet, "/v1/snapshots/"+url.PathEscape(id), nil, &out, c.timeout)
	return out, err
}

// DeleteSnapshot removes a snapshot; deleting an unknown id succeeds.
func (c *Client) DeleteSnapshot(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/snapshots/"+url.PathEscape(id), nil, nil, 3*c.timeout)
}

// OpenSnapshotFile streams one file of a snapshot (see the agent's routes).
// The caller closes the body and checks the checksum.
func (c *Client) OpenSnapshotFile(ctx context.Context, id, file string) (io.ReadCloser, int64, error) {
	req, err := c.newRequest(ctx, http.MethodGet, "/v1/snapshots/"+url.PathEscape(id)+"/files/"+url.PathEscape(file), nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := c.core.HTTP.Do(req)
	if err != nil {
		return nil, 0, fmt.Errorf("agent snapshot %s file %s: %w: %v", id, file, ErrUnavailable, err)
	}
	if resp.StatusCode >= 300 {
		defer func() { _ = resp.Body.Close() }()
		return nil, 0, decodeError("snapshot file "+id, resp)
	}
	return resp.Body, resp.ContentLength, nil
}

// Pool returns the warm pool status.
func (c *Client) Pool(ctx context.Context) ([]PoolStatus, error) {
	var out PoolList
	err := c.do(ctx, http.MethodGet, "/v1/pool", nil, &out, c.timeout)
	return out.Items, err
}

// SetPool sets the warm pool targets of one image.
func (c *Client) SetPool(ctx context.Context, image string, put PoolPut) ([]PoolStatus, error) {
	var out PoolList
	err := c.do(ctx, http.MethodPut, "/v1/pool/"+url.PathEscape(image), put, &out, c.timeout)
	return out.Items, err
}

// Images returns the agent's image cache.
func (c *Client) Images(ctx context.Context) ([]ImageStatus, error) {
	var out ImageList
	err := c.do(ctx, http.MethodGet, "/v1/images", nil, &out, c.timeout)
	return out.Items, err
}

// Image returns one image of the agent's cache; ErrNotFound when it has none.
func (c *Client) Image(ctx context.Context, sha256 string) (ImageStatus, error) {
	var out ImageStatus
	err := c.do(ctx, http.MethodGet, "/v1/images/"+url.PathEscape(sha256), nil, &out, c.timeout)
	return out, err
}

// PrefetchImage starts fetching an image into the agent's cache (or finds it
// there) and returns its status at once.
func (c *Client) PrefetchImage(ctx context.Context, src ImageSource) (ImageStatus, error) {
	var out ImageStatus
	err := c.do(ctx, http.MethodPut, "/v1/images/"+url.PathEscape(src.SHA256), src, &out, c.timeout)
	return out, err
}

// DeleteImage removes an image from the agent's cache; ErrConflict while a
// VM uses it. Removing an image the agent does not hold succeeds.
func (c *Client) DeleteImage(ctx context.Context, sha256 string) error {
	return c.do(ctx, http.MethodDelete, "/v1/images/"+url.PathEscape(sha256), nil, nil, c.timeout)
}

// ResizeDisk grows the VM's disk in place and returns the VM.
func (c *Client) ResizeDisk(ctx context.Context, id string, disk VMDisk) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPut, "/v1/vms/"+url.PathEscape(id)+"/disk", disk, &out, 6*c.timeout)
	return out, err
}

// PutOverlay makes the overlay network's bridge, vxlan device, entries and
// underlay allow set on the agent exactly as o says, and returns them as
// the kernel has them. ErrConflict when the agent has no underlay address.
func (c *Client) PutOverlay(ctx context.Context, network string, o Overlay) (OverlayState, error) {
	var out OverlayState
	err := c.do(ctx, http.MethodPut, "/v1/overlays/"+url.PathEscape(network), o, &out, c.timeout)
	return out, err
}

// DeleteOverlay removes the overlay network's vxlan device and entries
// from the agent (and its bridge when no VM is on it); removing one the
// agent does not have succeeds.
func (c *Client) DeleteOverlay(ctx context.Context, network string) error {
	return c.do(ctx, http.MethodDelete, "/v1/overlays/"+url.PathEscape(network), nil, nil, c.timeout)
}

// ListOverlays returns every overlay network the agent's kernel has.
func (c *Client) ListOverlays(ctx context.Context) ([]OverlayState, error) {
	var out []OverlayState
	err := c.do(ctx, http.MethodGet, "/v1/overlays", nil, &out, c.timeout)
	return out, err
}

func (c *Client) newRequest(ctx context.Context, method, path string, body []byte) (*http.Request, error) {
	return c.core.NewRequest(ctx, &httpclient.Call{Method: method, Path: path, Op: "agent " + method + " " + path}, body)
}

// do sends one call with a per-attempt timeout, retrying connection errors
// and 5xx answers; every agent call is idempotent on its id.
func (c *Client) do(ctx context.Context, method, path string, in, out any, timeout time.Duration) error {
	return c.core.Do(ctx, &httpclient.Call{Method: method, Path: path, In: in, Out: out, Timeout: timeout})
}

// retryable: connection errors and 5xx answers, but not an attempt that
// timed out (the agent may still be working on it; sending it again would
// only wait again).
func retryable(err error) bool {
	return errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrTimedOut)
}

func transportError(call *httpclient.Call, base string, err error, timedOut bool) error {
	if timedOut {
		return fmt.Errorf("agent %s at %s: no answer within %v: %w: %w", call.Name(), base, call.Timeout, ErrUnavailable, ErrTimedOut)
	}
	return fmt.Errorf("agent %s at %s: %w: %v", call.Name(), base, ErrUnavailable, err)
}

func decodeAnswerError(call *httpclient.Call, base string, err error) error {
	return fmt.Errorf("agent %s at %s: decode answer: %w: %v", call.Name(), base, ErrUnavailable, err)
}

// Bounds of what an error answer may contribute to an Error: the envelope
// of a kvmd agent is kept (its code and the start of its message); any
// other body is dropped, never repeated to whoever reads the error.
const (
	// maxAnswer bounds a JSON answer (a list of many thousand VMs fits).
	maxAnswer       = 256 << 20
	maxErrorBody    = 8 << 10
	maxErrorMessage = 1024
)

var errorCodePattern = regexp.MustCompile(`^[a-z_]{1,40}$`)

func decodeError(op string, resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	return answerError(&httpclient.Call{Op: op}, "", resp.StatusCode, b)
}

// answerError keeps the envelope of a kvmd agent (its code and the start
// of its message) and drops any other body.
func answerError(call *httpclient.Call, _ string, status int, b []byte) error {
	var env ErrorBody
	e := &Error{Status: status, Op: call.Name(), Code: "http_" + strconv.Itoa(status)}
	if json.Unmarshal(b, &env) == nil && errorCodePattern.MatchString(env.Error.Code) {
		e.Code, e.Message = env.Error.Code, boundMessage(env.Error.Message)
	}
	return e
}

// boundMessage keeps the first maxErrorMessage bytes of a message, on a
// rune boundary, with control characters replaced.
func boundMessage(m string) string {
	m = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(m, "?"))
	if len(m) <= maxErrorMessage {
		return m
	}
	cut := maxErrorMessage
	for cut > 0 && !utf8.RuneStart(m[cut]) {
		cut--
	}
	return m[:cut] + "..."
}

// CreateVolume creates the volume with this id, or returns it when it
// exists with the same spec (ErrConflict with another).
func (c *Client) CreateVolume(ctx context.Context, id string, spec VolumeSpec) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodPut, "/v1/volumes/"+url.PathEscape(id), spec, &out, 6*c.timeout)
	return out, err
}

// GetVolume returns one volume; ErrNotFound when the agent does not have it.
func (c *Client) GetVolume(ctx context.Context, id string) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodGet, "/v1/volumes/"+url.PathEscape(id), nil, &out, c.timeout)
	return out, err
}

// ListVolumes returns every volume on the agent.
func (c *Client) ListVolumes(ctx context.Context) ([]Volume, error) {
	var out VolumeList
	err := c.do(ctx, http.MethodGet, "/v1/volumes", nil, &out, c.timeout)
	return out.Items, err
}

// DeleteVolume removes a volume and its file; deleting an unknown id
// succeeds, an attached volume is ErrConflict (code volume_attached).
func (c *Client) DeleteVolume(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/volumes/"+url.PathEscape(id), nil, nil, 3*c.timeout)
}

// ResizeVolume grows a volume (online when it is attached to a running VM).
func (c *Client) ResizeVolume(ctx context.Context, id string, sizeMiB int64) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodPost, "/v1/volumes/"+url.PathEscape(id)+"/resize", VolumeResize{SizeMiB: sizeMiB}, &out, 6*c.timeout)
	return out, err
}

// AttachVolume attaches a volume to a VM (hot when the VM runs) and
// returns the VM; attaching it again the same way changes nothing.
func (c *Client) AttachVolume(ctx context.Context, vm, volume string, readOnly bool) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPut, "/v1/vms/"+url.PathEscape(vm)+"/volumes/"+url.PathEscape(volume),
		VolumeAttachment{ReadOnly: readOnly}, &out, 6*c.timeout)
	return out, err
}

// DetachVolume detaches a volume from a VM (hot when the VM runs); a
// volume that is not attached is no error.
func (c *Client) DetachVolume(ctx context.Context, vm, volume string) error {
	return c.do(ctx, http.MethodDelete, "/v1/vms/"+url.PathEscape(vm)+"/volumes/"+url.PathEscape(volume), nil, nil, 6*c.timeout)
}

// OpenVolumeContent streams a volume as one qcow2 (for a move to another
// agent) and returns the sha256 the source sent for it and its size_mib.
// The caller closes the body and checks the digest as it reads.
func (c *Client) OpenVolumeContent(ctx context.Context, id string) (body io.ReadCloser, sha256 string, sizeMiB int64, err error) {
	return c.openVolumeContent(ctx, id, "/v1/volumes/"+url.PathEscape(id)+"/content")
}

// OpenSnapshotVolumeContent streams the frozen point that snapshot took
// of volume as one qcow2 (for a fork child on another agent), like
// OpenVolumeContent.
func (c *Client) OpenSnapshotVolumeContent(ctx context.Context, snapshot, volume string) (body io.ReadCloser, sha256 string, sizeMiB int64, err error) {
	return c.openVolumeContent(ctx, volume,
		"/v1/snapshots/"+url.PathEscape(snapshot)+"/volumes/"+url.PathEscape(volume)+"/content")
}

func (c *Client) openVolumeContent(ctx context.Context, id, path string) (body io.ReadCloser, sha256 string, sizeMiB int64, err error) {
	req, err := c.newRequest(ctx, http.MethodGet, path, nil)
	if err != nil {
		return nil, "", 0, err
	}
	resp, err := c.core.HTTP.Do(req)
	if err != nil {
		return nil, "", 0, fmt.Errorf("agent volume %s content: %w: %v", id, ErrUnavailable, err)
	}
	if resp.StatusCode >= 300 {
		defer func() { _ = resp.Body.Close() }()
		return nil, "", 0, decodeError("volume content "+id, resp)
	}
	size, _ := strconv.ParseInt(resp.Header.Get("X-Volume-Size-Mib"), 10, 64)
	return resp.Body, resp.Header.Get("X-Volume-Sha256"), size, nil
}
