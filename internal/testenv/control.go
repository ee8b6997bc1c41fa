package testenv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// ControlOptions configures StartControl.
type ControlOptions struct {
	DatabaseURL  string        // "" = SQLite in DataDir
	Token        string        // default "control-token"
	AgentToken   string        // default "agent-token"
	SyncInterval time.Duration // host monitor interval; default 1s in tests
	// DataDir holds the SQLite database; default t.TempDir(). Give the same
	// directory to a second StartControl to restart on the same database.
	DataDir string
	// Hooks inject failures into the control plane (see control.Hooks).
	Hooks *control.Hooks
	// NoMonitor leaves the host monitor off; the test drives its rounds
	// with Service.SyncNow, one at a time.
	NoMonitor bool
	// AgentTimeout, DeadAfter, CreateGrace and OrphanGrace pass through to
	// control.Options (defaults: AgentTimeout 5 s, the others control's).
	AgentTimeout time.Duration
	DeadAfter    int
	CreateGrace  time.Duration
	OrphanGrace  time.Duration
	// AllowInsecureAgents accepts http:// agents off loopback, as
	// --allow-insecure-agents does: for tests whose agents listen on an
	// address of their own network namespace.
	AllowInsecureAgents bool
	// ForkRetryBackoff passes through to control.Options (default control's).
	ForkRetryBackoff time.Duration
}

// Control is a control API running in the test process with real HTTP.
type Control struct {
	URL     string // "http://127.0.0.1:port"
	Token   string
	Client  *client.Client // already authenticated
	Service *control.Service
	Store   *store.Store
	DataDir string

	stopOnce sync.Once
	stop     func()
}

// TestLogEnv, when set, sends the control API's JSON logs to stderr.
const TestLogEnv = "KVM_TEST_LOG"

func testLogger() *slog.Logger {
	if os.Getenv(TestLogEnv) != "" {
		return slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// StartControl starts a control API in process on 127.0.0.1 (its host
// monitor included) and stops it at the end of the test.
func StartControl(t testing.TB, opts ControlOptions) *Control {
	t.Helper()
	if opts.Token == "" {
		opts.Token = "control-token"
	}
	if opts.AgentToken == "" {
		opts.AgentToken = "agent-token"
	}
	if opts.SyncInterval == 0 {
		opts.SyncInterval = time.Second
	}
	if opts.DatabaseURL == "" && opts.DataDir == "" {
		opts.DataDir = t.TempDir()
	}
	log := testLogger()
	ctx := context.Background()
	st, err := store.Open(ctx, store.Config{DatabaseURL: opts.DatabaseURL, DataDir: opts.DataDir, Logger: log})
	if err != nil {
		t.Fatalf("start control: %v", err)
	}
	if opts.AgentTimeout == 0 {
		opts.AgentTimeout = 5 * time.Second
	}
	svc, err := control.New(ctx, st, control.Options{AgentToken: opts.AgentToken, SyncInterval: opts.SyncInterval,
		AgentTimeout: opts.AgentTimeout, Logger: log, Hooks: opts.Hooks, DeadAfter: opts.DeadAfter,
		CreateGrace: opts.CreateGrace, OrphanGrace: opts.OrphanGrace, AllowInsecureAgents: opts.AllowInsecureAgents,
		ForkRetryBackoff: opts.ForkRetryBackoff})
	if err != nil {
		_ = st.Close()
		t.Fatalf("start control: %v", err)
	}
	handler, err := httpapi.New(svc, httpapi.Options{Token: opts.Token, Logger: log})
	if err != nil {
		_ = st.Close()
		t.Fatalf("start control: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = st.Close()
		t.Fatalf("start control: %v", err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	monitorCtx, stopMonitor := context.WithCancel(ctx)
	var wg sync.WaitGroup
	if !opts.NoMonitor {
		wg.Go(func() { _ = svc.Run(monitorCtx) })
	}
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("control API server: %v", err)
		}
	})
	c := &Control{
		URL: "http://" + ln.Addr().String(), Token: opts.Token, Service: svc, Store: st, DataDir: opts.DataDir,
	}
	c.Client = client.New(c.URL, opts.Token, client.WithTimeout(time.Minute))
	c.stop = func() {
		shutdownCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
		stopMonitor()
		wg.Wait()
		_ = st.Close()
	}
	t.Cleanup(c.Stop)
	return c
}

// Stop shuts the control API down (idempotent; also runs at cleanup).
func (c *Control) Stop() { c.stopOnce.Do(c.stop) }

// RegisterHost registers a host agent (PUT /v1/hosts/{name}) and fails the
// test if that does not work.
func (c *Control) RegisterHost(t testing.TB, name, address string) api.Host {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	h, err := c.Client.PutHost(ctx, name, api.HostPut{Address: address})
	if err != nil {
		t.Fatalf("register host %s at %s: %v", name, address, err)
	}
	return h
}

// CreateMany creates n VMs of one shape at once (image sim, 1 vCPU),
// spreading the requests over the replicas in turn, and counts how many
// were placed and how many were refused with no_capacity. Any other error
// fails the test.
func CreateMany(ctx context.Context, t testing.TB, replicas []*Control, n int, memoryMiB, diskMiB int64) (placed, full int64) {
	t.Helper()
	var ok, noRoom atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		c := replicas[i%len(replicas)]
		wg.Go(func() {
			_, err := c.Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm-%04d", i), Image: "sim",
				VCPUs: 1, MemoryMiB: memoryMiB, DiskMiB: diskMiB}, "")
			var e *client.Error
			switch {
			case err == nil:
				ok.Add(1)
			case errors.As(err, &e) && e.Code == api.CodeNoCapacity:
				noRoom.Add(1)
			default:
				t.Errorf("create vm-%04d: %v", i, err)
			}
		})
	}
	wg.Wait()
	return ok.Load(), noRoom.Load()
}
