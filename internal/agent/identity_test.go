package agent_test

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
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

// A pull goes only to a peer that proves the key the control plane pinned
// for it: a server at the pull address that answers with another key (or
// anything else) never receives the agent token, and nothing is pulled.
func TestPullOnlyFromAPeerThatProvesItsPinnedKey(t *testing.T) {
	ctx := context.Background()
	puller := serveAgentAt(t, t.TempDir(), nil)
	source := serveAgentAt(t, t.TempDir(), nil) // the agent whose key is pinned
	impostor := serveAgentAt(t, t.TempDir(), nil)
	var mu sync.Mutex
	var auths []string
	recorder := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		auths = append(auths, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		// It relays to an agent with another key, which signs for the
		// recorder's address because it was told that address.
		proxyTo(t, impostor.url, w, r)
	}))
	defer recorder.Close()
	if err := impostor.agent.AllowAddress(recorder.URL); err != nil {
		t.Fatal(err)
	}
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64,
		Snapshot: &agentapi.SnapshotSource{ID: "snap", Address: recorder.URL, PublicKey: agentapi.EncodeKey(source.agent.PublicKey())}}
	_, err := agentapi.NewClient(puller.url, token, agentapi.WithRetries(0)).CreateVM(ctx, "child", spec)
	if err == nil || !strings.Contains(err.Error(), "did not prove the identity") {
		t.Fatalf("pull from a peer with another key: %v; want refused", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(auths) == 0 {
		t.Fatal("the recorder got no request: the test proves nothing")
	}
	for _, a := range auths {
		if strings.Contains(a, "Bearer") {
			t.Errorf("the peer that did not prove its key got %q", a)
		}
	}
	for _, bad := range []agentapi.SnapshotSource{
		{ID: "snap", Address: recorder.URL},
		{ID: "snap", Address: recorder.URL + "/x?y=", PublicKey: agentapi.EncodeKey(source.agent.PublicKey())},
		{ID: "snap", PublicKey: agentapi.EncodeKey(source.agent.PublicKey())},
		{ID: "snap", Address: recorder.URL, PublicKey: "not-a-key"},
	} {
		spec.Snapshot = &bad
		_, err := agentapi.NewClient(puller.url, token, agentapi.WithRetries(0)).CreateVM(ctx, "child", spec)
		var ae *agentapi.Error
		if !errors.As(err, &ae) || ae.Status != http.StatusBadRequest {
			t.Errorf("snapshot source %+v: %v; want 400", bad, err)
		}
	}
}

// proxyTo forwards one request to target and copies the answer back.
func proxyTo(t *testing.T, target string, w http.ResponseWriter, r *http.Request) {
	req, err := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.RequestURI(), r.Body)
	if err != nil {
		t.Error(err)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}
