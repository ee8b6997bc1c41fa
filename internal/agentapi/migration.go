package agentapi

// Live and cold migration of a VM from one agent (the source) to another
// (the target). The control plane prepares the target (PutIncoming), then
// starts the migration on the source (Migrate) and follows it there
// (Migration). The source streams the VM to the target over one
// authenticated connection per channel (OpenMigrationStream); the target
// runs the VM only once the source says the stream completed
// (CommitIncoming), so that exactly one copy ever runs.

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"
)

// VM states of a migration (beside those of agentapi.VM.State).
const (
	// StateIncoming is a VM prepared on a target agent for a migration:
	// its files are there and, for a live one, its VMM waits for the
	// stream, paused. It never runs before its source commits it.
	StateIncoming = "incoming"
	// StateMigrated is a VM on its source agent whose migration completed:
	// its VMM is stopped for good (QEMU paused in postmigrate) and its
	// files are kept until the control plane deletes it there.
	StateMigrated = "migrated"
	// StateFailed is an incoming VM whose migration failed or was
	// cancelled: it never ran; Reason says why. The control plane deletes it.
	StateFailed = "failed"
)

// Migration states (Migration.State).
const (
	MigrationRunning   = "running"
	MigrationCompleted = "completed"
	MigrationFailed    = "failed"
	MigrationCancelled = "cancelled"
)

// Migration phases (Migration.Phase).
const (
	PhaseSetup       = "setup"         // the channels open, the target answers
	PhaseFiles       = "files"         // the VM's files move (a cold migration: all of it)
	PhaseDisk        = "disk"          // the running disk overlay is mirrored to the target
	PhaseMemory      = "memory"        // memory pre-copy while the guest runs
	PhaseStopAndCopy = "stop-and-copy" // the guest is paused; the rest moves
	PhaseSwitch      = "switch"        // the stream completed; the target is told to run the VM
	PhaseDone        = "done"
)

// Migration stream channels (OpenMigrationStream).
const (
	ChannelFiles  = "files"  // the VM's files (a tar stream)
	ChannelMemory = "memory" // the VMM's migration stream (QEMU: migrate)
	ChannelDisk   = "disk"   // the disk mirror (QEMU: NBD to the target's overlay)
)

// PeerRef is another agent as the control plane pinned it: its address
// and its identity key (EncodeKey).
type PeerRef struct {
	Address   string `json:"address"`
	PublicKey string `json:"public_key"`
}

// IncomingSpec is the body of PUT /v1/vms/{id}/incoming on the target: the
// VM as the control plane knows it, the agent it comes from, and whether
// it moves live (the VM runs on the source) or cold (it is stopped there).
type IncomingSpec struct {
	Spec   VMSpec  `json:"spec"`
	Source PeerRef `json:"source"`
	Live   bool    `json:"live"`
}

// MigrateSpec is the body of POST /v1/vms/{id}/migrate on the source.
type MigrateSpec struct {
	Target PeerRef `json:"target"`
	Live   bool    `json:"live"`
	// MaxDowntimeMS is the longest pause of the guest the switch may take
	// (QEMU's downtime-limit); 0: the agent's default (300 ms, QEMU's).
	MaxDowntimeMS int64 `json:"max_downtime_ms,omitempty"`
	// TimeoutS bounds the whole migration: one that has not converged by
	// then is cancelled, the VM running on the source; 0: the agent's
	// default (600 s).
	TimeoutS int64 `json:"timeout_s,omitempty"`
}

// MigrationBytes is how far one part of a migration is, in bytes.
type MigrationBytes struct {
	Total       int64 `json:"total"`
	Transferred int64 `json:"transferred"`
	Remaining   int64 `json:"remaining"`
}

// Migration is the answer of GET /v1/vms/{id}/migration on the source.
type Migration struct {
	VMID   string         `json:"vm_id"`
	Target PeerRef        `json:"target"`
	Live   bool           `json:"live"`
	State  string         `json:"state"`
	Phase  string         `json:"phase"`
	Memory MigrationBytes `json:"memory"`
	Disk   MigrationBytes `json:"disk"`
	// DowntimeMS is how long the guest was paused for the switch (QEMU's
	// downtime), TotalMS the whole migration, SetupMS its setup (QEMU's
	// figures for a live one), once completed; while it runs, TotalMS is
	// the time so far and ExpectedDowntimeMS QEMU's estimate.
	// VMMDowntimeMS is the VMM's own part of it (QEMU's downtime: from
	// the source's stop to the end of the stream); DowntimeMS adds the
	// commit, until the target runs the guest.
	DowntimeMS         int64 `json:"downtime_ms"`
	VMMDowntimeMS      int64 `json:"vmm_downtime_ms,omitempty"`
	ExpectedDowntimeMS int64 `json:"expected_downtime_ms,omitempty"`
	TotalMS            int64 `json:"total_ms"`
	SetupMS            int64 `json:"setup_ms"`
	// Throttle is the vCPU throttle auto-converge applied, in percent.
	Throttle int64 `json:"throttle_pct,omitempty"`
	// SourcePaused: the VM was paused on the source; it stays paused on
	// the target.
	SourcePaused bool      `json:"source_paused,omitempty"`
	StartedAt    time.Time `json:"started_at"`
	Error        string    `json:"error,omitempty"`
}

// MigrationStreamUpgrade is the Upgrade protocol of a migration stream.
const MigrationStreamUpgrade = "kvm-migration/1"

// PutIncoming prepares VM id on this (target) agent for a migration; it
// returns the VM in state incoming (or its state after the migration when
// the same spec is there already).
func (c *Client) PutIncoming(ctx context.Context, id string, spec IncomingSpec) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPut, "/v1/vms/"+url.PathEscape(id)+"/incoming", spec, &out, max(6*c.timeout, OpBound))
	return out, err
}

// CommitIncoming tells the target that the stream of VM id completed on
// the source (whose copy is stopped for good): the target runs it (live)
// or records it stopped (cold). The target refuses (409) unless its own
// end of the stream completed. Committing again changes nothing.
func (c *Client) CommitIncoming(ctx context.Context, id string) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/incoming/commit", nil, &out, 6*c.timeout)
	return out, err
}

// IncomingCommit is the optional body of POST /v1/vms/{id}/incoming/commit.
type IncomingCommit struct {
	// Paused keeps a live VM paused on the target (it was paused on the
	// source) instead of running it.
	Paused bool `json:"paused,omitempty"`
}

// CommitIncomingAs is CommitIncoming with a body.
func (c *Client) CommitIncomingAs(ctx context.Context, id string, body IncomingCommit) (VM, error) {
	var out VM
	err := c.do(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/incoming/commit", body, &out, 6*c.timeout)
	return out, err
}

// Migrate starts migrating VM id to spec.Target; the answer (202) is the
// migration as it starts. A second call while one runs returns it.
func (c *Client) Migrate(ctx context.Context, id string, spec MigrateSpec) (Migration, error) {
	var out Migration
	err := c.do(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/migrate", spec, &out, 3*c.timeout)
	return out, err
}

// Migration returns the migration of VM id (ErrNotFound when it has none).
func (c *Client) Migration(ctx context.Context, id string) (Migration, error) {
	var out Migration
	err := c.do(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id)+"/migration", nil, &out, c.timeout)
	return out, err
}

// CancelMigration cancels the migration of VM id: the VM keeps running on
// the source. A migration that completed is not undone (409), unless the
// target holds no running copy (it failed or was deleted there): then the
// source runs the VM again.
func (c *Client) CancelMigration(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/vms/"+url.PathEscape(id)+"/migration", nil, nil, 6*c.timeout)
}

// OpenMigrationStream opens one channel of VM id's migration stream on
// this (target) agent: an HTTP request upgraded to a raw connection. The
// caller (the source agent) must then prove its identity on it (the
// target's challenge) before anything else moves; see the agent package.
func (c *Client) OpenMigrationStream(ctx context.Context, id, channel string) (net.Conn, error) {
	u, err := url.Parse(c.BaseURL())
	if err != nil {
		return nil, err
	}
	host := u.Host
	if u.Port() == "" {
		if u.Scheme == "https" {
			host += ":443"
		} else {
			host += ":80"
		}
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, fmt.Errorf("migration stream of vm %s to %s: %w: %v", id, c.BaseURL(), ErrUnavailable, err)
	}
	if u.Scheme == "https" {
		var cfg *tls.Config
		if t, ok := c.core.HTTP.Transport.(*http.Transport); ok && t.TLSClientConfig != nil {
			cfg = t.TLSClientConfig.Clone()
		} else {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		if cfg.ServerName == "" {
			cfg.ServerName = u.Hostname()
		}
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = conn.Close()
			return nil, fmt.Errorf("migration stream of vm %s to %s: tls: %w", id, c.BaseURL(), err)
		}
		conn = tc
	}
	req, err := c.newRequest(ctx, http.MethodGet, "/v1/vms/"+url.PathEscape(id)+"/incoming/stream?channel="+url.QueryEscape(channel), nil)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", MigrationStreamUpgrade)
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	if err := req.Write(conn); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("migration stream of vm %s to %s: %w: %v", id, c.BaseURL(), ErrUnavailable, err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("migration stream of vm %s to %s: %w: %v", id, c.BaseURL(), ErrUnavailable, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer func() { _ = conn.Close(); _ = resp.Body.Close() }()
		return nil, decodeError("migration stream "+id, resp)
	}
	_ = resp.Body.Close() // a 101 has none; the connection is ours

	_ = conn.SetDeadline(time.Time{})
	return &bufferedConn{Conn: conn, r: br}, nil
}

// bufferedConn is a connection whose first bytes may sit in r already.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// CloseWrite half-closes the connection where it can (TCP).
func (b *bufferedConn) CloseWrite() error {
	if cw, ok := b.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

var _ io.Reader = (*bufferedConn)(nil)
