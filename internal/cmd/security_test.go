package cmd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// selfSignedCert writes a self-signed certificate for 127.0.0.1 (its own
// CA) and its key as PEM files, and returns their paths and a pool that
// trusts it.
func selfSignedCert(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kvmd test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

// startServer runs a kvmd subcommand until the end of the test and returns
// the address from its "listening" log line.
func startServer(t *testing.T, run func(context.Context, []string, Env, *controlLogSink) error, args []string, listening string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := &controlLogSink{}
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, func(string) string { return "" }, logs) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: %v", listening, err)
			}
		case <-time.After(time.Minute):
			t.Errorf("%s: no shutdown within a minute", listening)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		for line := range strings.Lines(logs.String()) {
			var rec struct {
				Msg     string `json:"msg"`
				Address string `json:"address"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == listening {
				return rec.Address
			}
		}
		select {
		case err := <-done:
			t.Fatalf("%s: the server ended: %v\n%s", listening, err, logs.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not listening after 30 s; logs:\n%s", listening, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func controlRunner(ctx context.Context, args []string, getenv Env, logs *controlLogSink) error {
	return runControl(ctx, args, getenv, logs)
}

func agentRunner(ctx context.Context, args []string, getenv Env, logs *controlLogSink) error {
	return runAgent(ctx, args, getenv, logs)
}

// trusting returns an HTTP client that trusts pool; http1 keeps it on
// HTTP/1.1 (for the header limit, which HTTP/2 enforces on the client).
func trusting(pool *x509.CertPool, http1 bool) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if http1 {
		tr.ForceAttemptHTTP2 = false
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// TestTLSBothAPIs runs kvmd agent and kvmd control with certificates: the
// typed clients talk HTTPS to both, the control API reaches the agent at
// an https:// address through --agent-ca-file, and plain HTTP or a client
// that does not trust the certificate gets nothing.
func TestTLSBothAPIs(t *testing.T) {
	certFile, keyFile, pool := selfSignedCert(t)
	agentAddr := startServer(t, agentRunner, []string{
		"--listen", "127.0.0.1:0", "--state-dir", t.TempDir(), "--driver", "sim",
		"--vcpus", "4", "--memory-mib", "4096", "--disk-mib", "100000",
		"--token", "agent-secret", "--tls-cert", certFile, "--tls-key", keyFile,
	}, "kvmd agent listening")
	controlAddr := startServer(t, controlRunner, []string{
		"--listen", "127.0.0.1:0", "--data-dir", t.TempDir(), "--token", "control-secret",
		"--agent-token", "agent-secret", "--tls-cert", certFile, "--tls-key", keyFile,
		"--agent-ca-file", certFile, "--sync-interval", "1s",
	}, "control API listening")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ac := agentapi.NewClient("https://"+agentAddr, "agent-secret", agentapi.WithHTTPClient(trusting(pool, false)))
	if _, err := ac.Info(ctx); err != nil {
		t.Fatalf("agent over HTTPS: %v", err)
	}
	cc := client.New("https://"+controlAddr, "control-secret", client.WithHTTPClient(trusting(pool, false)))
	h, err := cc.PutHost(ctx, "h1", api.HostPut{Address: "https://" + agentAddr})
	if err != nil {
		t.Fatalf("register an agent at an https:// address: %v", err)
	}
	if !h.Alive || h.Capacity.VCPUs != 4 {
		t.Errorf("host read over HTTPS: %+v", h)
	}
	vm, err := cc.CreateVM(ctx, api.VMCreate{Name: "tls-vm", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, "")
	if err != nil {
		t.Fatalf("create through the control API over HTTPS: %v", err)
	}
	if _, err := ac.GetVM(ctx, vm.ID); err != nil {
		t.Errorf("the VM created over HTTPS is not on the agent: %v", err)
	}

	// Plain HTTP to the TLS ports is refused before any handler runs.
	for _, addr := range []string{agentAddr, controlAddr} {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Errorf("plain HTTP to %s: %d, want 400", addr, resp.StatusCode)
			}
		}
	}
	// A client that does not trust the certificate gets an error.
	untrusting := client.New("https://"+controlAddr, "control-secret", client.WithRetries(0, 0))
	// (the client keeps the cause as text, so the test reads the text)
	if _, err := untrusting.AllHosts(ctx); err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Errorf("client without the CA: %v; want an unknown authority error", err)
	}
}

// TestHeaderLimit: both servers answer 431 to a request whose headers are
// larger than 64 KiB and serve one just under it.
func TestHeaderLimit(t *testing.T) {
	certFile, keyFile, pool := selfSignedCert(t)
	agentAddr := startServer(t, agentRunner, []string{
		"--listen", "127.0.0.1:0", "--state-dir", t.TempDir(), "--driver", "sim",
		"--vcpus", "4", "--memory-mib", "4096", "--disk-mib", "100000", "--token", "agent-secret",
	}, "kvmd agent listening")
	controlAddr := startServer(t, controlRunner, []string{
		"--listen", "127.0.0.1:0", "--data-dir", t.TempDir(), "--token", "control-secret",
		"--agent-token", "agent-secret", "--tls-cert", certFile, "--tls-key", keyFile,
	}, "control API listening")
	hc := trusting(pool, true)
	for _, tc := range []struct{ url, token string }{
		{"http://" + agentAddr + "/v1/info", "agent-secret"},
		{"https://" + controlAddr + "/v1/hosts", "control-secret"},
	} {
		for _, c := range []struct {
			pad  int
			want int
		}{{maxHeaderBytes - 8<<10, http.StatusOK}, {1 << 20, http.StatusRequestHeaderFieldsTooLarge}} {
			req, err := http.NewRequest(http.MethodGet, tc.url, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Authorization", "Bearer "+tc.token)
			req.Header.Set("X-Pad", strings.Repeat("p", c.pad))
			resp, err := hc.Do(req)
			if err != nil {
				t.Errorf("GET %s with a %d byte header: %v", tc.url, c.pad, err)
				continue
			}
			_ = resp.Body.Close()
			if resp.StatusCode != c.want {
				t.Errorf("GET %s with a %d byte header: %d, want %d", tc.url, c.pad, resp.StatusCode, c.want)
			}
		}
	}
}

func TestControlRefusesOneTokenForBoth(t *testing.T) {
	err := runControl(context.Background(), []string{"--listen", "127.0.0.1:0", "--data-dir", t.TempDir(),
		"--token", "same", "--agent-token", "same"}, func(string) string { return "" }, &controlLogSink{})
	if err == nil || !strings.Contains(err.Error(), "the API token and the agent token are the same") {
		t.Errorf("control with one token for clients and agents: %v", err)
	}
}

// TestTLSBetweenAgents: an agent spawns a child from a snapshot that it
// pulls over HTTPS from another agent, trusting it through --peer-ca-file;
// without that flag the pull fails on the certificate.
func TestTLSBetweenAgents(t *testing.T) {
	certFile, keyFile, pool := selfSignedCert(t)
	agentArgs := func(extra ...string) []string {
		return append([]string{
			"--listen", "127.0.0.1:0", "--state-dir", t.TempDir(), "--driver", "sim",
			"--vcpus", "4", "--memory-mib", "4096", "--disk-mib", "100000",
			"--token", "agent-secret", "--tls-cert", certFile, "--tls-key", keyFile,
		}, extra...)
	}
	source := startServer(t, agentRunner, agentArgs(), "kvmd agent listening")
	trustingPeer := startServer(t, agentRunner, agentArgs("--peer-ca-file", certFile), "kvmd agent listening")
	notTrusting := startServer(t, agentRunner, agentArgs(), "kvmd agent listening")
	hc := trusting(pool, false)
	clientOf := func(addr string) *agentapi.Client {
		return agentapi.NewClient("https://"+addr, "agent-secret", agentapi.WithHTTPClient(hc), agentapi.WithRetries(0))
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}
	if _, err := clientOf(source).CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := clientOf(source).CreateSnapshot(ctx, "snap", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatal(err)
	}
	// As the control plane does: the source joins, and its key is pinned.
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		t.Fatal(err)
	}
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(nonce), Host: "source", Address: "https://" + source}
	proof, err := clientOf(source).Identity(ctx, ch)
	if err != nil {
		t.Fatal(err)
	}
	key, err := agentapi.VerifyIdentity(ch, proof, nil, "agent-secret")
	if err != nil {
		t.Fatal(err)
	}
	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "snap", Address: "https://" + source, PublicKey: agentapi.EncodeKey(key)}
	vm, err := clientOf(trustingPeer).CreateVM(ctx, "child", child)
	if err != nil {
		t.Fatalf("spawn from a snapshot pulled over HTTPS: %v", err)
	}
	if vm.StartedFrom != "snapshot" {
		t.Errorf("child started from %q, want snapshot", vm.StartedFrom)
	}
	_, err = clientOf(notTrusting).CreateVM(ctx, "child", child)
	if err == nil || !strings.Contains(err.Error(), "pull snapshot") || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("spawn on an agent that does not trust the source: %v; want a failed pull", err)
	}
}
