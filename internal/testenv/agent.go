package testenv

import (
	"context"
	"crypto/ed25519"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// AgentOptions configures StartAgent.
type AgentOptions struct {
	Driver    string // "sim" (default) or "qemu"
	Token     string // default "agent-token"
	VCPUs     int64  // capacity to advertise (sim needs them; qemu: default host values)
	MemoryMiB int64
	DiskMiB   int64
	StateDir  string // default t.TempDir()
	ImageDir  string // qemu: default GuestImageDir(t)
	// CacheDir holds the agent's cache of registered images; default a
	// folder of the test's own (never the shared ImageDir).
	CacheDir string
	// ImageFetch tunes the image cache's fetches (e.g. a short backoff).
	ImageFetch image.Config
	// Addresses are more addresses the agent proves its identity for
	// (agent.Config.Addresses), beside its own IP and port.
	Addresses []string
	// UnderlayAddress is the agent's --underlay-address (overlay
	// networks); it must be on an interface of the test's namespace.
	UnderlayAddress string
	// ConsoleLogBytes and ConsoleTrimInterval: qemu: each VM's console
	// log cap and how often it is trimmed (qemu.Options); default the
	// driver's.
	ConsoleLogBytes     int64
	ConsoleTrimInterval time.Duration
}

// Agent is a host agent running in the test process with real HTTP.
type Agent struct {
	Address string // "http://127.0.0.1:port", what a host registers with (the same as URL)
	URL     string // "http://127.0.0.1:port"
	// PublicKey is the agent's identity key, which the control plane pins.
	PublicKey ed25519.PublicKey
	Token     string
	Client    *agentapi.Client
	StateDir  string

	opts     AgentOptions
	hostport string // "127.0.0.1:port", where it listens
	mu       sync.Mutex
	srv      *http.Server
	ag       *agent.Agent
	done     chan struct{}
}

// Sim capacity when the test gives none: a roomy host.
const (
	simVCPUs     = 64
	simMemoryMiB = 256 << 10
	simDiskMiB   = 4 << 20
)

// StartAgent starts an agent in process on 127.0.0.1 and stops it at the
// end of the test. With the qemu driver, the cleanup also kills every QEMU
// process of the agent's VMs, even when the test failed.
func StartAgent(t testing.TB, opts AgentOptions) *Agent {
	t.Helper()
	if opts.Driver == "" {
		opts.Driver = "sim"
	}
	if opts.Token == "" {
		opts.Token = "agent-token"
	}
	if opts.StateDir == "" {
		opts.StateDir = t.TempDir()
	}
	if opts.CacheDir == "" {
		opts.CacheDir = t.TempDir()
	}
	switch opts.Driver {
	case "sim":
		if opts.VCPUs == 0 {
			opts.VCPUs = simVCPUs
		}
		if opts.MemoryMiB == 0 {
			opts.MemoryMiB = simMemoryMiB
		}
		if opts.DiskMiB == 0 {
			opts.DiskMiB = simDiskMiB
		}
	case "qemu":
		RequireQEMU(t)
		if opts.ImageDir == "" {
			opts.ImageDir = GuestImageDir(t)
		}
	default:
		t.Fatalf("testenv: unknown agent driver %q: want sim or qemu", opts.Driver)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: listen for agent: %v", err)
	}
	a := &Agent{
		Address: "http://" + ln.Addr().String(), URL: "http://" + ln.Addr().String(),
		Token: opts.Token, StateDir: opts.StateDir, opts: opts, hostport: ln.Addr().String(),
	}
	a.Client = agentapi.NewClient(a.Address, a.Token)
	t.Cleanup(func() {
		a.Stop()
		if opts.Driver == "qemu" {
			killQEMUProcesses(t, opts.StateDir)
		}
	})
	a.start(t, ln)
	return a
}

func (a *Agent) start(t testing.TB, ln net.Listener) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	driver, err := newAgentDriver(ctx, a.opts, agentTestLogger(t))
	if err != nil {
		_ = ln.Close()
		t.Fatalf("testenv: agent driver: %v", err)
	}
	ag, err := agent.New(ctx, agent.Config{
		StateDir: a.opts.StateDir, Driver: driver, Token: a.opts.Token, Logger: agentTestLogger(t), Addresses: a.opts.Addresses,
		Capacity:      agentapi.Resources{VCPUs: a.opts.VCPUs, MemoryMiB: a.opts.MemoryMiB, DiskMiB: a.opts.DiskMiB},
		ImageCacheDir: a.opts.CacheDir, ImageFetch: a.opts.ImageFetch, UnderlayAddress: a.opts.UnderlayAddress,
	})
	if err != nil {
		_ = ln.Close()
		t.Fatalf("testenv: start agent: %v", err)
	}
	a.PublicKey = ag.PublicKey()
	handler := ag.Handler()
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	a.mu.Lock()
	a.srv, a.ag, a.done = srv, ag, done
	a.mu.Unlock()
}

func newAgentDriver(ctx context.Context, opts AgentOptions, log *slog.Logger) (agent.Driver, error) {
	if opts.Driver == "qemu" {
		return qemu.New(ctx, qemu.Options{ImageDir: opts.ImageDir, CacheDir: opts.CacheDir, Accel: Accel(), Logger: log,
			ConsoleLogBytes: opts.ConsoleLogBytes, ConsoleTrimInterval: opts.ConsoleTrimInterval})
	}
	return sim.New(sim.Options{ImageDir: opts.ImageDir, CacheDir: opts.CacheDir}), nil
}

// agentTestLogger sends the agent's logs to io.Discard unless KVM_TEST_LOG is set
// (then to stderr): 500 concurrent creates make a lot of lines.
func agentTestLogger(testing.TB) *slog.Logger {
	if os.Getenv("KVM_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// AllowAddress makes the agent prove its identity also for address, e.g.
// a proxy in front of it that a host is registered with.
func (a *Agent) AllowAddress(t testing.TB, address string) {
	t.Helper()
	a.mu.Lock()
	ag := a.ag
	a.mu.Unlock()
	if ag == nil {
		t.Fatal("testenv: AllowAddress on a stopped agent")
	}
	if err := ag.AllowAddress(address); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	a.mu.Lock()
	a.opts.Addresses = append(a.opts.Addresses, address)
	a.mu.Unlock()
}

// Stop makes the agent stop answering. Its VMs keep running, as with a real
// agent that stops. Stopping twice is fine.
func (a *Agent) Stop() {
	a.mu.Lock()
	srv, ag, done := a.srv, a.ag, a.done
	a.srv, a.ag, a.done = nil, nil, nil
	a.mu.Unlock()
	if srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		_ = srv.Close()
	}
	<-done
	_ = ag.Close()
}

// Restart stops the agent and starts a new one on the same state directory
// and the same address: it re-adopts the VMs the old one left running.
func (a *Agent) Restart(t testing.TB) {
	t.Helper()
	a.Stop()
	var ln net.Listener
	var err error
	// The port was just released; another process could take it, so fail
	// after a few tries rather than hang.
	for i := 0; i < 50; i++ {
		ln, err = net.Listen("tcp", a.hostport)
		if err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("testenv: restart agent on %s: %v", a.Address, err)
	}
	a.start(t, ln)
}

// killQEMUProcesses kills every QEMU process of the VMs under stateDir,
// found by the VM's pid file and checked against its command line, so that
// no test leaves a guest behind.
func killQEMUProcesses(t testing.TB, stateDir string) {
	dirs, _ := filepath.Glob(filepath.Join(stateDir, "vms", "*"))
	for _, dir := range dirs {
		for _, pid := range qemu.ProcessesOf(dir) {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				t.Errorf("testenv: kill qemu %d of %s: %v", pid, dir, err)
			}
		}
	}
	// Warm pool VMs, and VMs handed out from the pool, whose command line
	// names a pool directory.
	for _, pid := range qemu.ProcessesUnder(stateDir) {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			t.Errorf("testenv: kill qemu %d under %s: %v", pid, stateDir, err)
		}
	}
}

// CacheDir is the folder of the agent's image cache.
func (a *Agent) CacheDir() string { return a.opts.CacheDir }

// VolumeIDs lists the ids of the volumes the agent has, sorted, through
// its own API (GET /v1/volumes).
func (a *Agent) VolumeIDs(t testing.TB) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	vols, err := a.Client.ListVolumes(ctx)
	if err != nil {
		t.Fatalf("testenv: list volumes of agent %s: %v", a.URL, err)
	}
	ids := make([]string, 0, len(vols))
	for _, v := range vols {
		ids = append(ids, v.ID)
	}
	slices.Sort(ids)
	return ids
}
