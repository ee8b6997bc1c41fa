package control_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/limits"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// impostor is an HTTP server on 127.0.0.1 that pretends to be a host agent
// without holding the agent token: it answers every call as an agent would
// (an identity made with its own key, an info with capacity) and records
// the headers of every request it gets.
type impostor struct {
	url     string
	mu      sync.Mutex
	headers []http.Header
	paths   []string
	// status and body, when set, answer every request instead.
	status int
	body   string
}

func startImpostor(t *testing.T) *impostor {
	t.Helper()
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	im := &impostor{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	im.url = "http://" + ln.Addr().String()
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		im.mu.Lock()
		im.headers = append(im.headers, r.Header.Clone())
		im.paths = append(im.paths, r.Method+" "+r.URL.RequestURI())
		status, body := im.status, im.body
		im.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		if status != 0 {
			w.WriteHeader(status)
			_, _ = w.Write([]byte(body))
			return
		}
		var out any
		switch {
		case strings.HasPrefix(r.URL.Path, "/v1/identity"):
			// A proof made with a guessed token and its own key.
			out = map[string]string{
				"public_key": base64.StdEncoding.EncodeToString(pub),
				"signature":  base64.StdEncoding.EncodeToString(ed25519.Sign(key, []byte("anything"))),
				"join_proof": strings.Repeat("ab", 32),
			}
		case r.URL.Path == "/v1/vms":
			out = map[string]any{"items": []any{}}
		default:
			out = map[string]any{"capacity": map[string]int{"vcpus": 64, "memory_mib": 65536, "disk_mib": 65536},
				"accel": "kvm", "driver": "sim", "images": []string{"sim"}}
		}
		_ = json.NewEncoder(w).Encode(out)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return im
}

func (im *impostor) answer(status int, body string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	im.status, im.body = status, body
}

func (im *impostor) requests() ([]http.Header, []string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	return append([]http.Header(nil), im.headers...), append([]string(nil), im.paths...)
}

// assertNoCredentials fails the test if any request the impostor got
// carried an Authorization header (the agent token or any other).
func (im *impostor) assertNoCredentials(t *testing.T) {
	t.Helper()
	headers, paths := im.requests()
	for i, h := range headers {
		if h.Get("Authorization") != "" {
			t.Errorf("request %s to an address that never proved it is an agent carried Authorization %q", paths[i], h.Get("Authorization"))
		}
	}
}

// Finding 1: registering a host at an address that has not proved it is an
// agent of this fleet is refused, and that address never receives the
// agent token, neither at registration nor from the host monitor.
func TestUnjoinedAddressNeverReceivesTheAgentToken(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	im := startImpostor(t)
	_, err := noRetry(c).PutHost(ctx, "fake", api.HostPut{Address: im.url})
	if err == nil {
		t.Fatal("a host at an address that did not prove it holds the agent token was registered")
	}
	if code := apiCode(err); code != api.CodeInvalid && code != api.CodeConflict && code != api.CodeUnavailable {
		t.Errorf("register an impostor: %v; want invalid, conflict or unavailable", err)
	}
	if _, err := c.Client.GetHost(ctx, "fake"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("the impostor's host exists after a refused registration: %v", err)
	}
	c.Service.SyncNow(ctx)
	im.assertNoCredentials(t)
	if _, paths := im.requests(); len(paths) == 0 {
		t.Error("the impostor got no request at all: the test proves nothing")
	}
}

// Finding 1: a PUT that re-points a host to an address where another agent
// answers is refused, and the host's VMs are untouched (not marked missing,
// their capacity still held) after the next host sync.
func TestRepointToAnotherAgentRefused(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	a := testenv.StartAgent(t, testenv.AgentOptions{})
	b := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h", a.URL)
	vm, err := c.Client.CreateVM(ctx, smallVM("keep-me"), "")
	if err != nil {
		t.Fatal(err)
	}
	_, err = noRetry(c).PutHost(ctx, "h", api.HostPut{Address: b.URL})
	if apiCode(err) != api.CodeConflict {
		t.Fatalf("re-point host h to another agent: %v; want a conflict", err)
	}
	if !strings.Contains(err.Error(), "h") {
		t.Errorf("the error must name the host: %v", err)
	}
	c.Service.SyncNow(ctx)
	h, err := c.Client.GetHost(ctx, "h")
	if err != nil {
		t.Fatal(err)
	}
	if h.Address != a.URL {
		t.Errorf("host h address %q after a refused re-point, want %q", h.Address, a.URL)
	}
	got, err := c.Client.GetVM(ctx, vm.ID)
	if err != nil || got.ObservedState != api.StateRunning {
		t.Errorf("VM after a refused re-point: %+v %v; want running", got, err)
	}
	if alloc := hostAllocated(t, c, "h"); alloc != (api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}) {
		t.Errorf("host h allocation after a refused re-point: %+v", alloc)
	}
	checkLedger(t, c.Store)
}

// Re-pointing succeeds when the agent at the new address proves the
// pinned identity: the same agent (same state directory) moved to another
// port keeps its VMs.
func TestRepointToTheSameAgentMoved(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	a := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h", a.URL)
	vm, err := c.Client.CreateVM(ctx, smallVM("moves"), "")
	if err != nil {
		t.Fatal(err)
	}
	a.Stop()
	moved := testenv.StartAgent(t, testenv.AgentOptions{StateDir: a.StateDir})
	h, err := noRetry(c).PutHost(ctx, "h", api.HostPut{Address: moved.URL})
	if err != nil {
		t.Fatalf("re-point host h to its own agent on a new port: %v", err)
	}
	if h.Address != moved.URL {
		t.Errorf("address %q, want %q", h.Address, moved.URL)
	}
	c.Service.SyncNow(ctx)
	if got, err := c.Client.GetVM(ctx, vm.ID); err != nil || got.ObservedState != api.StateRunning {
		t.Errorf("VM after its agent moved: %+v %v; want running", got, err)
	}
}

// Finding 3: a host address is scheme://host:port and nothing else. Each
// bad address is a 400 and nothing is sent to it.
func TestHostAddressMustBeSchemeHostPort(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	im := startImpostor(t)
	hostport := strings.TrimPrefix(im.url, "http://")
	for _, addr := range []string{
		im.url + "/v1/secrets?x=",
		im.url + "/",
		im.url + "?x=",
		im.url + "#frag",
		"http://user:pw@" + hostport,
		"ftp://" + hostport,
		"http://127.0.0.1",
		"http://" + hostport + "/%2e%2e",
		hostport,
		"http:///" + hostport,
		"http://127.0.0.1:0",
		"http://127.0.0.1:99999",
	} {
		_, err := noRetry(c).PutHost(ctx, "h", api.HostPut{Address: addr})
		var e *client.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != api.CodeInvalid {
			t.Errorf("address %q: %v; want 400 invalid", addr, err)
		}
	}
	if _, paths := im.requests(); len(paths) != 0 {
		t.Errorf("bad addresses were called: %v", paths)
	}
}

// Finding 3: what an address answers is not echoed to the API client.
func TestAgentErrorBodiesAreNotEchoed(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	im := startImpostor(t)
	const secret = "TOP-SECRET-INTERNAL-PAGE"
	for _, status := range []int{http.StatusOK, http.StatusBadRequest, http.StatusNotFound, http.StatusInternalServerError} {
		body := strings.Repeat(secret+" ", 100)
		if status == http.StatusBadRequest {
			body = fmt.Sprintf(`{"error":{"code":"invalid","message":%q}}`, body)
		}
		im.answer(status, body)
		_, err := noRetry(c).PutHost(ctx, "h", api.HostPut{Address: im.url})
		if err == nil {
			t.Fatalf("status %d: registered", status)
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("status %d: the answer's body reached the API client: %v", status, err)
		}
	}
	im.assertNoCredentials(t)
}

// Finding 6: the control API refuses a VM the agents would refuse, before
// it reserves anything or calls an agent.
func TestVMLimitsCheckedBeforeReservation(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{VCPUs: 4096, MemoryMiB: 64 << 20, DiskMiB: 2 << 30})
	c.RegisterHost(t, "big", d.URL)
	for _, in := range []api.VMCreate{
		{Name: "cpus", Image: "sim", VCPUs: 1024, MemoryMiB: 1024, DiskMiB: 1024},
		{Name: "disk", Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1 << 30},
	} {
		_, err := noRetry(c).CreateVM(ctx, in, "")
		var e *client.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || strings.Contains(e.Message, "host big") {
			t.Errorf("create %s: %v; want a 400 from the control API's own checks", in.Name, err)
		}
	}
	if calls := d.Calls(); len(calls) != 0 {
		t.Errorf("the agent was asked: %v", calls)
	}
	if alloc := hostAllocated(t, c, "big"); alloc != (api.Resources{}) {
		t.Errorf("allocation after refused creates: %+v", alloc)
	}
}

// Hosts registered before agents joined have no pinned key: the host
// monitor challenges them before anything else, pins the key of a real
// agent, and sends an impostor nothing with the agent token (the host is
// marked not alive, so nothing is placed there).
func TestMonitorJoinsHostsWithoutAPinnedKey(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	real := testenv.StartAgent(t, testenv.AgentOptions{})
	im := startImpostor(t)
	for name, addr := range map[string]string{"old-real": real.URL, "old-fake": im.url} {
		if _, err := c.Store.UpsertHost(ctx, store.Host{Name: name, Address: addr, Schedulable: true, CPUAllocationRatio: 1}); err != nil {
			t.Fatal(err)
		}
	}
	c.Service.SyncNow(ctx)
	im.assertNoCredentials(t)
	fake, err := c.Store.GetHost(ctx, "old-fake")
	if err != nil {
		t.Fatal(err)
	}
	if fake.Alive || fake.AgentKey != "" {
		t.Errorf("host at an impostor's address after a sync: alive %v, key %q; want not alive, no key", fake.Alive, fake.AgentKey)
	}
	got, err := c.Store.GetHost(ctx, "old-real")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Alive || got.AgentKey != agentapi.EncodeKey(real.PublicKey) || got.Total.VCPUs == 0 {
		t.Errorf("host of a real agent after a sync: alive %v, key %q, total %+v; want alive, its key pinned, its capacity",
			got.Alive, got.AgentKey, got.Total)
	}
	if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "placed", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64, Host: "old-fake"}, ""); err == nil {
		t.Error("a VM was placed on the impostor's host")
	}
	im.assertNoCredentials(t)
}

// Finding 6: the control API and the agent share one set of limits: a VM
// at every limit is created by a real agent, one past a limit is refused
// by the control API with nothing reserved.
func TestVMLimitsAgreeWithTheAgent(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	ag := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 4 * limits.MaxVCPUs, MemoryMiB: 4 * limits.MaxMemoryMiB, DiskMiB: 4 * limits.MaxDiskMiB})
	c.RegisterHost(t, "big", ag.URL)
	atLimit := api.VMCreate{Name: "at-limit", Image: "sim", VCPUs: limits.MaxVCPUs, MemoryMiB: limits.MaxMemoryMiB, DiskMiB: limits.MaxDiskMiB}
	vm, err := noRetry(c).CreateVM(ctx, atLimit, "")
	if err != nil || vm.ObservedState != api.StateRunning {
		t.Fatalf("a VM at every limit: %+v %v; the agent must accept what the control API accepts", vm, err)
	}
	for _, in := range []api.VMCreate{
		{Name: "cpus", Image: "sim", VCPUs: limits.MaxVCPUs + 1, MemoryMiB: 64, DiskMiB: 64},
		{Name: "memory", Image: "sim", VCPUs: 1, MemoryMiB: limits.MaxMemoryMiB + 1, DiskMiB: 64},
		{Name: "disk", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: limits.MaxDiskMiB + 1},
	} {
		_, err := noRetry(c).CreateVM(ctx, in, "")
		var e *client.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || strings.Contains(e.Message, "host big") {
			t.Errorf("create %s past its limit: %v; want a 400 from the control API's own checks", in.Name, err)
		}
	}
	if alloc := hostAllocated(t, c, "big"); alloc != (api.Resources{VCPUs: limits.MaxVCPUs, MemoryMiB: limits.MaxMemoryMiB, DiskMiB: limits.MaxDiskMiB}) {
		t.Errorf("allocation: %+v; want the one VM at the limits", alloc)
	}
	if vms, err := ag.Client.ListVMs(ctx); err != nil || len(vms) != 1 {
		t.Errorf("the agent holds %d VMs (%v); want the one at the limits", len(vms), err)
	}
}

// A verified agent's server errors reach the API client as its status and
// code; their text (paths, causes) stays in the agent's log.
func TestAgentServerErrorTextIsNotRepeated(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
	c.RegisterHost(t, "h", d.URL)
	d.FailCreates(true)
	_, err := noRetry(c).CreateVM(ctx, smallVM("fails"), "")
	if err == nil || strings.Contains(err.Error(), "injected create failure") || !strings.Contains(err.Error(), "500") {
		t.Errorf("create failing on the agent: %v; want its status, not its text", err)
	}
}
