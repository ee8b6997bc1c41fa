package cmd

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// syncBuffer is a log sink that the agent goroutine writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freeAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().String()
}

func TestRunAgentSimServesAndShutsDown(t *testing.T) {
	addr := freeAddress(t)
	env := map[string]string{"KVMD_TOKEN": "env-token", "KVMD_VCPUS": "4"}
	args := []string{"--listen", addr, "--state-dir", t.TempDir(), "--driver", "sim",
		"--memory-mib", "4096", "--disk-mib", "10000"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- runAgent(ctx, args, func(k string) string { return env[k] }, &logs) }()

	c := agentapi.NewClient(addr, "env-token")
	var info agentapi.Info
	var err error
	for i := 0; i < 100; i++ {
		if info, err = c.Info(ctx); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("agent does not answer: %v; logs:\n%s", err, logs.String())
	}
	if info.Driver != "sim" || info.Capacity.VCPUs != 4 || info.Capacity.MemoryMiB != 4096 {
		t.Fatalf("info = %+v, want sim with 4 vcpus (from KVMD_VCPUS) and 4096 MiB", info)
	}
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz: %v %v", resp, err)
	}
	_ = resp.Body.Close()

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("runAgent after cancel: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("runAgent did not return after its context ended")
	}
	if !strings.Contains(logs.String(), "kvmd agent stopped") {
		t.Fatalf("no shutdown log line; logs:\n%s", logs.String())
	}
}

func TestRunAgentRefusesBadFlags(t *testing.T) {
	noEnv := func(string) string { return "" }
	dir := t.TempDir()
	cases := map[string][]string{
		"no token":        {"--state-dir", dir, "--driver", "sim"},
		"no state dir":    {"--token", "t", "--driver", "sim"},
		"sim no capacity": {"--token", "t", "--state-dir", dir, "--driver", "sim"},
		"unknown driver":  {"--token", "t", "--state-dir", dir, "--driver", "xen"},
		"half tls":        {"--token", "t", "--state-dir", dir, "--tls-cert", "c.pem"},
		"bad accel":       {"--token", "t", "--state-dir", dir, "--accel", "hvf"},
	}
	for name, args := range cases {
		var logs syncBuffer
		if err := runAgent(context.Background(), args, noEnv, &logs); err == nil {
			t.Errorf("%s: runAgent accepted %v", name, args)
		}
	}
}

// startSimAgent runs `kvmd agent` with the sim driver on a free loopback
// port and waits until it answers; it stops with the test.
func startSimAgent(t *testing.T, args []string, env map[string]string) string {
	t.Helper()
	addr := freeAddress(t)
	args = append([]string{"--listen", addr, "--state-dir", t.TempDir(), "--driver", "sim",
		"--vcpus", "2", "--memory-mib", "2048", "--disk-mib", "10000"}, args...)
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	var runErr error
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		runErr = runAgent(ctx, args, func(k string) string { return env[k] }, &logs)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-stopped:
		case <-time.After(30 * time.Second):
			t.Error("runAgent did not return after its context ended")
		}
	})
	for i := 0; i < 200; i++ {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			_ = resp.Body.Close()
			return addr
		}
		select {
		case <-stopped:
			t.Fatalf("runAgent %v: %v; logs:\n%s", args, runErr, logs.String())
		case <-time.After(25 * time.Millisecond):
		}
	}
	t.Fatalf("agent does not answer on %s; logs:\n%s", addr, logs.String())
	return ""
}

func metricsStatus(t *testing.T, addr, bearer string) int {
	t.Helper()
	return bearerStatus(t, context.Background(), http.MethodGet, "http://"+addr+"/metrics", bearer)
}

// bearerStatus sends one request with the bearer token ("" for none) and
// returns the answer's status.
func bearerStatus(t *testing.T, ctx context.Context, method, u, bearer string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, u, strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// The agent's /metrics takes a bearer token like the control API's:
// --metrics-token, KVMD_METRICS_TOKEN or --metrics-token-file. Without one
// it stays open, as before.
func TestAgentMetricsToken(t *testing.T) {
	fromEnv := startSimAgent(t, nil, map[string]string{"KVMD_TOKEN": "agent-token", "KVMD_METRICS_TOKEN": "scrape-token"})
	for _, c := range []struct {
		bearer string
		want   int
	}{{"", 401}, {"wrong", 401}, {"agent-token", 401}, {"scrape-token", 200}} {
		if got := metricsStatus(t, fromEnv, c.bearer); got != c.want {
			t.Errorf("agent with KVMD_METRICS_TOKEN: GET /metrics with bearer %q: %d; want %d", c.bearer, got, c.want)
		}
	}

	file := filepath.Join(t.TempDir(), "metrics-token")
	if err := os.WriteFile(file, []byte("file-scrape-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fromFile := startSimAgent(t, []string{"--token", "agent-token", "--metrics-token-file", file}, nil)
	if got := metricsStatus(t, fromFile, ""); got != 401 {
		t.Errorf("agent with --metrics-token-file: GET /metrics without a token: %d; want 401", got)
	}
	if got := metricsStatus(t, fromFile, "file-scrape-token"); got != 200 {
		t.Errorf("agent with --metrics-token-file: GET /metrics with its token: %d; want 200", got)
	}

	open := startSimAgent(t, []string{"--token", "agent-token"}, nil)
	if got := metricsStatus(t, open, ""); got != 200 {
		t.Errorf("agent without a metrics token: GET /metrics: %d; want 200 (open, as before)", got)
	}
}

// The metrics token is the scraper's own: the agent refuses one equal to
// its API token, which would let a scraper drive VMs.
func TestAgentRefusesMetricsTokenEqualToItsToken(t *testing.T) {
	var logs syncBuffer
	err := runAgent(context.Background(), []string{"--token", "same", "--metrics-token", "same", "--state-dir", t.TempDir(),
		"--driver", "sim", "--vcpus", "1", "--memory-mib", "512", "--disk-mib", "1000"}, func(string) string { return "" }, &logs)
	if err == nil || !strings.Contains(err.Error(), "metrics token") {
		t.Fatalf("runAgent with --metrics-token equal to --token: %v; want an error about the metrics token", err)
	}
}
