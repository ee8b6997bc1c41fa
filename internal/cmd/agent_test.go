package cmd

import (
	"bytes"
	"context"
	"net"
	"net/http"
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
