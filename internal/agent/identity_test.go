package agent_test

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// servedAgent is an agent on a real 127.0.0.1 listener.
type servedAgent struct {
	agent *agent.Agent
	url   string
	stop  func()
}

func serveAgentAt(t *testing.T, stateDir string, addresses []string) *servedAgent {
	t.Helper()
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: stateDir, Driver: sim.New(sim.Options{}), Token: token, NoSync: true, Addresses: addresses,
		Capacity: agentapi.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: a.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	s := &servedAgent{agent: a, url: "http://" + ln.Addr().String()}
	s.stop = func() { _ = srv.Close(); _ = a.Close() }
	t.Cleanup(s.stop)
	return s
}

func challenge(t *testing.T, host, address string) agentapi.IdentityChallenge {
	t.Helper()
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(b), Host: host, Address: address}
}

// The agent proves its identity without a token, for the address it is
// reached at; the proof checks out only with the agent token; its key
// survives a restart on the same state directory.
func TestAgentProvesItsIdentity(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	s := serveAgentAt(t, dir, nil)
	anon := agentapi.NewClient(s.url, "")
	ch := challenge(t, "h1", s.url)
	proof, err := anon.Identity(ctx, ch)
	if err != nil {
		t.Fatalf("identity without a token: %v", err)
	}
	key, err := agentapi.VerifyIdentity(ch, proof, nil, token)
	if err != nil {
		t.Fatalf("verify the join proof with the agent token: %v", err)
	}
	if !key.Equal(s.agent.PublicKey()) {
		t.Errorf("proved key %s, the agent's is %s", agentapi.KeyFingerprint(key), agentapi.KeyFingerprint(s.agent.PublicKey()))
	}
	if _, err := agentapi.VerifyIdentity(ch, proof, nil, "another-token"); !errors.Is(err, agentapi.ErrBadIdentity) {
		t.Errorf("join proof checked with another token: %v; want ErrBadIdentity", err)
	}
	// The proof is bound to its challenge: replayed for another nonce,
	// host or address it does not verify.
	for _, other := range []agentapi.IdentityChallenge{challenge(t, "h1", s.url), {Nonce: ch.Nonce, Host: "h2", Address: s.url},
		{Nonce: ch.Nonce, Host: "h1", Address: "http://127.0.0.2:1"}} {
		if _, err := agentapi.VerifyIdentity(other, proof, nil, token); !errors.Is(err, agentapi.ErrBadIdentity) {
			t.Errorf("proof replayed for %+v: %v; want ErrBadIdentity", other, err)
		}
	}
	s.stop()
	again := serveAgentAt(t, dir, nil)
	ch2 := challenge(t, "h1", again.url)
	proof2, err := agentapi.NewClient(again.url, "").Identity(ctx, ch2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agentapi.VerifyIdentity(ch2, proof2, key, ""); err != nil {
		t.Errorf("after a restart on the same state directory, the pinned key: %v", err)
	}
	fresh := serveAgentAt(t, t.TempDir(), nil)
	ch3 := challenge(t, "h1", fresh.url)
	proof3, err := agentapi.NewClient(fresh.url, "").Identity(ctx, ch3)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agentapi.VerifyIdentity(ch3, proof3, key, ""); !errors.Is(err, agentapi.ErrBadIdentity) {
		t.Errorf("another agent against the pinned key: %v; want ErrBadIdentity", err)
	}
}

// An agent signs only for an address it is reachable at: a relay at
// another address cannot borrow its answer, unless the agent was told
// that address (a proxy or DNS name in front of it).
func TestAgentSignsOnlyForItsOwnAddresses(t *testing.T) {
	ctx := context.Background()
	s := serveAgentAt(t, t.TempDir(), []string{"https://kvm-01.example.net:8471"})
	anon := agentapi.NewClient(s.url, "")
	for _, addr := range []string{"http://127.0.0.2:9999", "https://" + s.url[len("http://"):], "http://localhost:1"} {
		_, err := anon.Identity(ctx, challenge(t, "h1", addr))
		var ae *agentapi.Error
		if !errors.As(err, &ae) || ae.Status != http.StatusForbidden {
			t.Errorf("challenge for %s: %v; want 403", addr, err)
		}
	}
	ch := challenge(t, "h1", "https://kvm-01.example.net:8471")
	proof, err := anon.Identity(ctx, ch)
	if err != nil {
		t.Fatalf("challenge for an advertised address: %v", err)
	}
	if _, err := agentapi.VerifyIdentity(ch, proof, nil, token); err != nil {
		t.Errorf("proof for an advertised address: %v", err)
	}
	if err := s.agent.AllowAddress("http://127.0.0.2:9999"); err != nil {
		t.Fatal(err)
	}
	if _, err := anon.Identity(ctx, challenge(t, "h1", "http://127.0.0.2:9999")); err != nil {
		t.Errorf("challenge for an address allowed later: %v", err)
	}
	for _, bad := range []agentapi.IdentityChallenge{
		{Nonce: "short", Host: "h1", Address: s.url},
		{Nonce: challenge(t, "", "").Nonce, Host: "bad host\n", Address: s.url},
		{Nonce: challenge(t, "", "").Nonce, Host: "h1", Address: s.url + "/path"},
	} {
		_, err := anon.Identity(ctx, bad)
		var ae *agentapi.Error
		if !errors.As(err, &ae) || ae.Status != http.StatusBadRequest {
			t.Errorf("challenge %+v: %v; want 400", bad, err)
		}
	}
}
