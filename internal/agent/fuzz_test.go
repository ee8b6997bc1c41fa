package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// fuzzAgent is the real agent handler on the sim driver, served in process.
type fuzzAgent struct {
	agent *agent.Agent
	vmID  string // a running VM the action and snapshot targets aim at
}

func newFuzzAgent(f testing.TB) *fuzzAgent {
	f.Helper()
	// A fuzzed snapshot address must not reach the network: every peer
	// dial fails at once (the pull then answers 502).
	peer := &http.Client{Transport: &http.Transport{
		DialContext: func(_ context.Context, _, addr string) (net.Conn, error) {
			return nil, fmt.Errorf("fuzz: dial %s refused", addr)
		},
	}}
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: f.TempDir(), Driver: sim.New(sim.Options{}), Token: token, PeerHTTPClient: peer, NoSync: true,
		Capacity: agentapi.Resources{VCPUs: 64, MemoryMiB: 1 << 20, DiskMiB: 1 << 22},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
		Pool:     agent.PoolOptions{MaxSize: 4},
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = a.Close() })
	vm, _, err := a.CreateVM(context.Background(), "fuzz-source", agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64})
	if err != nil {
		f.Fatal(err)
	}
	return &fuzzAgent{agent: a, vmID: vm.ID}
}

// agentState is what a refused request must leave as it was.
type agentState struct {
	vms     []agentapi.VM
	targets []agentapi.PoolStatus
}

func (fa *fuzzAgent) state() agentState {
	s := agentState{vms: fa.agent.ListVMs(context.Background())}
	for _, p := range fa.agent.PoolStatus() {
		if p.Size == 0 {
			// A shape whose target was cleared stays listed, with size 0,
			// only until the filler has destroyed its surplus VMs: the
			// filler removes it on its own, not the request.
			continue
		}
		p.Ready, p.Booting = 0, 0 // the filler changes these on its own
		s.targets = append(s.targets, p)
	}
	return s
}

// do sends one request and checks: no 5xx (502 only where allow502: a
// failed pull from a peer), the JSON envelope and nothing changed on every
// refusal.
func (fa *fuzzAgent) do(t *testing.T, method, path string, body []byte, allow502 bool) int {
	t.Helper()
	before := fa.state()
	req := httptest.NewRequest(method, "/", bytes.NewReader(body))
	req.URL = &url.URL{Path: path}
	req.RequestURI = path
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	fa.agent.Handler().ServeHTTP(rec, req)
	status := rec.Code
	if status >= 500 && (!allow502 || status != http.StatusBadGateway) {
		t.Fatalf("%s %s %q: %d %s", method, path, body, status, rec.Body.Bytes())
	}
	if status < 400 {
		return status
	}
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("%s %s: %d with Content-Type %q: %s", method, path, status, ct, rec.Body.Bytes())
	}
	var env agentapi.ErrorBody
	dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil || env.Error.Code == "" || env.Error.Message == "" {
		t.Fatalf("%s %s: %d body is not the error envelope (%v): %s", method, path, status, err, rec.Body.Bytes())
	}
	if after := fa.state(); !reflect.DeepEqual(before, after) {
		t.Fatalf("%s %s %q was refused with %d but changed the agent:\nbefore %+v\nafter  %+v", method, path, body, status, before, after)
	}
	return status
}

var agentBodySeeds = []string{
	``, ` `, `null`, `[]`, `{}`, `"x"`, `1`, `{"a":1}`, `{"image":`, `{}{}`, `{} x`,
	`{"vcpus":1e400}`, `{"vcpus":-1}`, `{"vcpus":9223372036854775808}`, "{\"image\":\"\xff\"}",
	`{"image":"\u0000"}`, `{"shapes":null}`, `{"shapes":[{}]}`, strings.Repeat(`[`, 10000),
}

func FuzzAgentPutVM(f *testing.F) {
	fa := newFuzzAgent(f)
	for _, s := range agentBodySeeds {
		f.Add("vm-1", []byte(s))
	}
	f.Add("vm-1", []byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`))
	f.Add("vm-2", []byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"stopped":true,"no_warm":true}`))
	f.Add("vm-3", []byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"snapshot":{"id":"s1"}}`))
	f.Add("vm-4", []byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"snapshot":{"id":"s1","address":"10.0.0.1:8471"}}`))
	f.Add("fuzz-source", []byte(`{"image":"sim","vcpus":2,"memory_mib":64,"disk_mib":64}`))
	f.Add("../etc", []byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`))
	f.Add("vm-5", []byte(`{"image":"../../etc/passwd","vcpus":1,"memory_mib":64,"disk_mib":64}`))
	f.Fuzz(func(t *testing.T, id string, body []byte) {
		fa.do(t, http.MethodPut, "/v1/vms/"+url.PathEscape(id), body, true)
	})
}

func FuzzAgentAction(f *testing.F) {
	fa := newFuzzAgent(f)
	for _, a := range []string{"start", "stop", "pause", "resume", "reboot", "", "..", "START"} {
		f.Add(true, "", a)
		f.Add(false, "nope", a)
	}
	f.Fuzz(func(t *testing.T, existing bool, id, action string) {
		if existing {
			id = fa.vmID
		}
		fa.do(t, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/"+url.PathEscape(action), nil, false)
	})
}

func FuzzAgentPutSnapshot(f *testing.F) {
	fa := newFuzzAgent(f)
	for _, s := range agentBodySeeds {
		f.Add("snap-1", []byte(s), false)
	}
	f.Add("snap-1", []byte(`{"vm_id":"SOURCE"}`), true)
	f.Add("snap-2", []byte(`{"vm_id":"SOURCE","pause_source":true}`), true)
	f.Add("snap-3", []byte(`{"vm_id":"nope"}`), false)
	f.Add("../x", []byte(`{"vm_id":"SOURCE"}`), true)
	f.Fuzz(func(t *testing.T, id string, body []byte, useSource bool) {
		if useSource {
			body = bytes.ReplaceAll(body, []byte("SOURCE"), []byte(fa.vmID))
		}
		ctx := context.Background()
		_, errBefore := fa.agent.GetSnapshot(ctx, id)
		status := fa.do(t, http.MethodPut, "/v1/snapshots/"+url.PathEscape(id), body, false)
		if status >= 400 {
			if _, errAfter := fa.agent.GetSnapshot(ctx, id); (errBefore == nil) != (errAfter == nil) {
				t.Fatalf("refused snapshot %q changed whether it exists: before %v, after %v", id, errBefore, errAfter)
			}
		}
	})
}

func FuzzAgentPutPool(f *testing.F) {
	fa := newFuzzAgent(f)
	for _, s := range agentBodySeeds {
		f.Add("sim", []byte(s))
	}
	f.Add("sim", []byte(`{"shapes":[{"vcpus":1,"memory_mib":64,"disk_mib":64,"size":1}]}`))
	f.Add("sim", []byte(`{"shapes":[]}`))
	f.Add("sim", []byte(`{"shapes":[{"vcpus":1,"memory_mib":64,"disk_mib":64,"size":1000}]}`))
	f.Add("nope", []byte(`{"shapes":[{"vcpus":1,"memory_mib":64,"disk_mib":64,"size":1}]}`))
	f.Add("..", []byte(`{"shapes":[]}`))
	f.Fuzz(func(t *testing.T, image string, body []byte) {
		fa.do(t, http.MethodPut, "/v1/pool/"+url.PathEscape(image), body, false)
	})
}

func FuzzAgentConsole(f *testing.F) {
	fa := newFuzzAgent(f)
	for _, q := range []string{"", "1", "0", "-1", "1048576", "1048577", "abc", "1e3", "99999999999999999999"} {
		f.Add(true, "", q)
	}
	f.Add(false, "nope", "")
	f.Fuzz(func(t *testing.T, existing bool, id, bytesParam string) {
		if existing {
			id = fa.vmID
		}
		path := "/v1/vms/" + url.PathEscape(id) + "/console"
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.URL = &url.URL{Path: path, RawQuery: url.Values{"bytes": {bytesParam}}.Encode()}
		req.RequestURI = req.URL.RequestURI()
		req.Header.Set("Authorization", "Bearer "+token)
		rec := httptest.NewRecorder()
		fa.agent.Handler().ServeHTTP(rec, req)
		if rec.Code >= 500 {
			t.Fatalf("GET %s?bytes=%q: %d %s", path, bytesParam, rec.Code, rec.Body.Bytes())
		}
		if rec.Code >= 400 && !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") {
			t.Fatalf("GET %s?bytes=%q: %d without the JSON envelope: %s", path, bytesParam, rec.Code, rec.Body.Bytes())
		}
	})
}

// FuzzAgentIdentity: POST /v1/identity (no token) answers 200, 400 or 403
// and changes nothing; a 200 answers the challenge that was sent, with the
// agent's own key and a join proof made with its token.
func FuzzAgentIdentity(f *testing.F) {
	fa := newFuzzAgent(f)
	const advertised = "https://kvm-01.example.net:8471"
	if err := fa.agent.AllowAddress(advertised); err != nil {
		f.Fatal(err)
	}
	nonce := agentapi.NewNonce(bytes.Repeat([]byte{7}, 32))
	for _, s := range agentBodySeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"nonce":"` + nonce + `","host":"h1","address":"` + advertised + `"}`))
	f.Add([]byte(`{"nonce":"` + nonce + `","host":"","address":"` + advertised + `"}`))
	f.Add([]byte(`{"nonce":"` + nonce + `","host":"h1","address":"http://127.0.0.1:8471"}`))
	f.Add([]byte(`{"nonce":"` + nonce + `","host":"h1","address":"` + advertised + `/x?y="}`))
	f.Add([]byte(`{"nonce":"` + nonce + `","host":"h1\n","address":"` + advertised + `"}`))
	f.Add([]byte(`{"nonce":"short","host":"h1","address":"` + advertised + `"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/v1/identity", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		before := fa.state()
		fa.agent.Handler().ServeHTTP(rec, req)
		switch rec.Code {
		case http.StatusOK:
			var ch agentapi.IdentityChallenge
			var proof agentapi.IdentityProof
			if err := json.Unmarshal(body, &ch); err != nil {
				t.Fatalf("200 for a body that is not a challenge %q: %v", body, err)
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &proof); err != nil {
				t.Fatalf("200 answer is not a proof: %s", rec.Body.Bytes())
			}
			key, err := agentapi.VerifyIdentity(ch, proof, nil, token)
			if err != nil || !key.Equal(fa.agent.PublicKey()) {
				t.Fatalf("proof for %q does not verify with the agent's key and token: %v", body, err)
			}
			if ch.Address != advertised {
				t.Fatalf("signed for %q, which this agent was not told it is reachable at", ch.Address)
			}
		case http.StatusBadRequest, http.StatusForbidden, http.StatusRequestEntityTooLarge:
		default:
			t.Fatalf("identity %q: %d %s", body, rec.Code, rec.Body.Bytes())
		}
		if after := fa.state(); !reflect.DeepEqual(before, after) {
			t.Fatalf("identity %q changed the agent", body)
		}
	})
}
