package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// fuzzControl is the real control API handler on SQLite in a temporary
// directory with one sim agent registered as host h1, served in process
// (no listener) so that a fuzz run makes thousands of requests a second.
type fuzzControl struct {
	handler http.Handler
	svc     *control.Service
	store   *store.Store
	token   string
	vmID    string // a running VM the PATCH and fork targets aim at
	forkID  string // a fork of it with one child, once forks are served
}

const fuzzToken = "fuzz-control-token"

func newFuzzControl(f testing.TB, opts ...func(*httpapi.Options)) *fuzzControl {
	f.Helper()
	ctx := context.Background()
	ag := testenv.StartAgent(f, testenv.AgentOptions{})
	st, err := store.Open(ctx, store.Config{DataDir: f.TempDir()})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = st.Close() })
	// Fuzzed host addresses must not reach the network: every dial other
	// than the one to the sim agent fails at once, so that a PUT /v1/hosts
	// with a made-up address answers 503 fast instead of waiting on DNS.
	dialer := &net.Dialer{Timeout: time.Second}
	agentHTTP := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if "http://"+addr != ag.Address {
				return nil, fmt.Errorf("fuzz: dial %s refused: only the sim agent %s is reachable", addr, ag.Address)
			}
			return dialer.DialContext(ctx, network, addr)
		},
	}}
	svc, err := control.New(ctx, st, control.Options{AgentToken: ag.Token, AgentHTTPClient: agentHTTP,
		AgentTimeout: 2 * time.Second, SyncInterval: time.Hour})
	if err != nil {
		f.Fatal(err)
	}
	hopts := httpapi.Options{Token: fuzzToken}
	for _, o := range opts {
		o(&hopts)
	}
	h, err := httpapi.New(svc, hopts)
	if err != nil {
		f.Fatal(err)
	}
	if _, err := svc.PutHost(ctx, "h1", api.HostPut{Address: ag.Address}); err != nil {
		f.Fatal(err)
	}
	vm, err := svc.CreateVM(ctx, api.VMCreate{Name: "fuzz-source", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, "")
	if err != nil {
		f.Fatal(err)
	}
	fc := &fuzzControl{handler: h, svc: svc, store: st, token: fuzzToken, vmID: vm.ID}
	if fc.served(http.MethodPatch, "/v1/forks/:id") {
		fork, err := svc.CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 1}, "")
		if err != nil {
			f.Fatal(err)
		}
		fc.forkID = fork.ID
	}
	return fc
}

// served tells whether the handler has a route for method and path (the
// fork routes arrive with the fork issue).
func (fc *fuzzControl) served(method, path string) bool {
	e, ok := fc.handler.(*echo.Echo)
	if !ok {
		return false
	}
	for _, r := range e.Routes() {
		if r.Method == method && r.Path == path {
			return true
		}
	}
	return false
}

// snapshot is what a refused request must leave as it was: every VM and
// every host registration (not the observed fields, which the agent owns).
type controlSnapshot struct {
	vms    []api.VM
	hosts  []api.Host
	images []api.Image
	tokens []api.Token
}

func (fc *fuzzControl) snapshot(t *testing.T) controlSnapshot {
	t.Helper()
	ctx := context.Background()
	vms, err := fc.svc.ListVMs(ctx, control.VMQuery{Page: control.Page{Size: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	hosts, err := fc.svc.ListHosts(ctx, control.Page{Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	images, err := fc.svc.ListImages(ctx, control.Page{Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := fc.svc.ListTokens(ctx, control.Page{Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	s := controlSnapshot{vms: vms.Items, hosts: hosts.Items, images: images.Items, tokens: tokens.Items}
	for i := range s.images {
		s.images[i].Hosts = nil // what the agents report, not what a request wrote
	}
	for i := range s.vms {
		s.vms[i].ObservedState = ""
	}
	for i := range s.hosts {
		s.hosts[i].LastSeen, s.hosts[i].Alive = nil, false
	}
	return s
}

// do sends one request to the handler and checks the properties every
// answer has: no panic, no 5xx (except 503 unavailable where allowed:
// an agent that cannot be reached), and on every 4xx the one JSON error
// envelope with a code that matches the status, and nothing written.
func (fc *fuzzControl) do(t *testing.T, method, path string, body []byte, header map[string]string, allow503 bool) int {
	t.Helper()
	before := fc.snapshot(t)
	req := httptest.NewRequest(method, "/", bytes.NewReader(body))
	req.URL = &url.URL{Path: path, RawPath: ""}
	req.RequestURI = path
	req.Header.Set("Authorization", "Bearer "+fc.token)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	fc.handler.ServeHTTP(rec, req)
	status := rec.Code
	if status >= 500 && (!allow503 || status != http.StatusServiceUnavailable) {
		t.Fatalf("%s %s %q: %d %s", method, path, body, status, rec.Body.Bytes())
	}
	if status < 400 {
		return status
	}
	checkEnvelope(t, method+" "+path, status, rec)
	if after := fc.snapshot(t); !reflect.DeepEqual(before, after) {
		t.Fatalf("%s %s %q was refused with %d but changed the fleet:\nbefore %+v\nafter  %+v", method, path, body, status, before, after)
	}
	return status
}

var statusOfCode = map[string][]int{
	api.CodeInvalid:             {400, 405},
	api.CodeUnauthorized:        {401},
	api.CodeNotFound:            {404},
	api.CodeNoRoute:             {404},
	api.CodeForbidden:           {403},
	api.CodeConflict:            {409},
	api.CodeNoCapacity:          {409},
	api.CodeNoAddress:           {409},
	api.CodeIdempotencyMismatch: {422},
	api.CodeInFlight:            {409},
	api.CodeTooLarge:            {413},
	api.CodeUnavailable:         {503},
	api.CodeVersionSkew:         {409},
}

func checkEnvelope(t *testing.T, what string, status int, rec *httptest.ResponseRecorder) {
	t.Helper()
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("%s: %d with Content-Type %q, want the JSON envelope: %s", what, status, ct, rec.Body.Bytes())
	}
	var env api.ErrorBody
	dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		t.Fatalf("%s: %d body is not the error envelope (%v): %s", what, status, err, rec.Body.Bytes())
	}
	if env.Error.Code == "" || env.Error.Message == "" {
		t.Fatalf("%s: %d envelope without code or message: %s", what, status, rec.Body.Bytes())
	}
	if !containsInt(statusOfCode[env.Error.Code], status) {
		t.Fatalf("%s: code %q answered with status %d: %s", what, env.Error.Code, status, rec.Body.Bytes())
	}
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// Seeds shared by the body targets: the shapes a decoder gets wrong.
var bodySeeds = []string{
	``, ` `, `null`, `[]`, `{}`, `"x"`, `1`, `{"a":1}`, `{"name":`, `{}{}`, `{} x`,
	`{"vcpus":1e400}`, `{"vcpus":-1}`, `{"vcpus":9223372036854775808}`, `{"labels":null}`,
	`{"labels":{"":""}}`, "{\"name\":\"\xff\"}", `{"name":"\u0000"}`, `{"count":1.5}`,
	strings.Repeat(`[`, 10000), strings.Repeat(`{"a":`, 5000),
}

func FuzzCreateVM(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add([]byte(s), "")
	}
	f.Add([]byte(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`), "key-1")
	f.Add([]byte(`{"name":"vm2","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"host":"h1","power_state":"stopped","labels":{"team":"a"}}`), "")
	f.Add([]byte(`{"name":"fuzz-source","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`), "")
	f.Add([]byte(`{"name":"vm3","image":"sim","vcpus":1000,"memory_mib":64,"disk_mib":64}`), "")
	f.Add([]byte(`{"name":"vm4","image":"nope","vcpus":1,"memory_mib":64,"disk_mib":64,"host":"h9"}`), "k")
	f.Add([]byte(`{"name":"vm5","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"network_interfaces":[{"network":"default","port_forwards":[{"guest_port":80}]}]}`), "")
	f.Add([]byte(`{"name":"vm6","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"network_interfaces":[{"network":"nope","ipv4_address":"10.0.0.300"}]}`), "")
	f.Add([]byte(`{"name":"vm7","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"network_interfaces":[]}`), "")
	f.Fuzz(func(t *testing.T, body []byte, key string) {
		h := map[string]string{}
		if key != "" && validHeaderValue(key) {
			h["Idempotency-Key"] = key
		}
		fc.do(t, http.MethodPost, "/v1/vms", body, h, false)
	})
}

func FuzzPatchVM(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add(true, "", []byte(s))
	}
	f.Add(true, "", []byte(`{"power_state":"stopped"}`))
	f.Add(true, "", []byte(`{"power_state":"running","labels":{"a":"b"}}`))
	f.Add(true, "", []byte(`{"power_state":"paused"}`))
	f.Add(true, "", []byte(`{"labels":{"bad key!":"x"}}`))
	f.Add(true, "", []byte(`{"labels":{"a":"c"},"disk_mib":1}`))
	f.Add(true, "", []byte(`{"disk_mib":1000000000}`))
	f.Add(true, "", []byte(`{"power_state":"stopped","disk_mib":-5}`))
	f.Add(false, "nope", []byte(`{"power_state":"stopped"}`))
	f.Add(false, "../../x", []byte(`{}`))
	f.Fuzz(func(t *testing.T, existing bool, id string, body []byte) {
		if existing {
			id = fc.vmID
		}
		fc.do(t, http.MethodPatch, "/v1/vms/"+url.PathEscape(id), body, nil, false)
	})
}

func FuzzCreateImage(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add([]byte(s))
	}
	sha := strings.Repeat("ab", 32)
	f.Add([]byte(`{"name":"img1","source_url":"http://127.0.0.1:1/x.qcow2","sha256":"` + sha + `","format":"qcow2"}`))
	f.Add([]byte(`{"name":"img2","source_url":"file:///srv/x.tar","sha256":"` + sha + `","format":"kernel","min_disk_mib":64}`))
	f.Add([]byte(`{"name":"img3","source_url":"ftp://127.0.0.1/x","sha256":"` + sha + `","format":"qcow2"}`))
	f.Add([]byte(`{"name":"img4","source_url":"http://127.0.0.1:1/x","sha256":"XYZ","format":"qcow2"}`))
	f.Add([]byte(`{"name":"img5","source_url":"http://127.0.0.1:1/x","sha256":"` + sha + `","format":"vmdk","min_disk_mib":-1}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fc.do(t, http.MethodPost, "/v1/images", body, nil, false)
	})
}

func FuzzPutHost(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add("h2", []byte(s))
	}
	f.Add("h2", []byte(`{"address":"127.0.0.1:1"}`))
	f.Add("h2", []byte(`{"address":"https://agent.example:8471","labels":{"rack":"r1"},"schedulable":false,"cpu_allocation_ratio":4,"memory_reserved_mib":512}`))
	f.Add("h2", []byte(`{"address":"a:1","warm_pool":[{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"size":2}]}`))
	f.Add("bad name!", []byte(`{"address":"a:1"}`))
	f.Add("h2", []byte(`{"address":"ftp://x"}`))
	f.Add("h2", []byte(`{"address":"a:1","cpu_allocation_ratio":-1}`))
	f.Fuzz(func(t *testing.T, name string, body []byte) {
		// h1 is the one reachable agent: a valid body for it is a real update.
		if name == "h1" {
			return
		}
		fc.do(t, http.MethodPut, "/v1/hosts/"+url.PathEscape(name), body, nil, true)
	})
}

func FuzzCreateNetwork(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"name":"lan","mode":"nat","cidr":"10.20.0.0/24"}`))
	f.Add([]byte(`{"name":"lan2","mode":"nat","cidr":"10.20.0.0/16","gateway":"10.20.255.254","dhcp":false,"hosts":["h1"]}`))
	f.Add([]byte(`{"name":"br","mode":"bridge","bridge":"br0","cidr":"192.168.1.0/30"}`))
	f.Add([]byte(`{"name":"u","mode":"user","cidr":"10.0.0.0/8"}`))
	f.Add([]byte(`{"name":"x","mode":"nat","cidr":"10.1.2.3/33","gateway":"::1"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fc.do(t, http.MethodPost, "/v1/networks", body, nil, false)
	})
}

func FuzzPatchNetwork(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add("default", []byte(s))
	}
	f.Add("default", []byte(`{"hosts":["h1","h2"]}`))
	f.Add("default", []byte(`{"hosts":["h1","h1"]}`))
	f.Add("default", []byte(`{"hosts":null}`))
	f.Add("nope", []byte(`{"hosts":[]}`))
	f.Add("../x", []byte(`{}`))
	f.Fuzz(func(t *testing.T, name string, body []byte) {
		fc.do(t, http.MethodPatch, "/v1/networks/"+url.PathEscape(name), body, nil, false)
	})
}

func FuzzPlacement(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`))
	f.Add([]byte(`{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,"host":"h1"}`))
	f.Add([]byte(`{"image":"sim","vcpus":0,"memory_mib":64,"disk_mib":64}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fc.do(t, http.MethodPost, "/v1/placements", body, nil, false)
	})
}

func FuzzCreateFork(f *testing.F) {
	fc := newFuzzControl(f)
	if !fc.served(http.MethodPost, "/v1/forks") {
		f.Skip("POST /v1/forks is not served yet")
	}
	for _, s := range bodySeeds {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(`{"source_vm_id":"SOURCE","count":1}`), true)
	f.Add([]byte(`{"source_vm_id":"SOURCE","count":0}`), true)
	f.Add([]byte(`{"source_vm_id":"SOURCE","count":100000,"placement":"spread"}`), true)
	f.Add([]byte(`{"source_vm_id":"SOURCE","count":2,"pause_source":true,"placement":"colocate"}`), true)
	f.Add([]byte(`{"source_vm_id":"nope","count":1}`), false)
	f.Fuzz(func(t *testing.T, body []byte, useSource bool) {
		if useSource {
			body = bytes.ReplaceAll(body, []byte("SOURCE"), []byte(fc.vmID))
		}
		fc.do(t, http.MethodPost, "/v1/forks", body, nil, false)
	})
}

func FuzzPatchFork(f *testing.F) {
	fc := newFuzzControl(f)
	if !fc.served(http.MethodPatch, "/v1/forks/:id") {
		f.Skip("PATCH /v1/forks/{id} is not served yet")
	}
	for _, s := range bodySeeds {
		f.Add(true, "", []byte(s))
	}
	f.Add(true, "", []byte(`{"count":2}`))
	f.Add(true, "", []byte(`{"count":1}`))
	f.Add(true, "", []byte(`{"count":-1}`))
	f.Add(true, "", []byte(`{"count":65}`))
	f.Add(true, "", []byte(`{"count":null}`))
	f.Add(false, "nope", []byte(`{"count":2}`))
	f.Fuzz(func(t *testing.T, existing bool, id string, body []byte) {
		if existing {
			id = fc.forkID
		}
		fc.do(t, http.MethodPatch, "/v1/forks/"+url.PathEscape(id), body, nil, false)
	})
}

func FuzzCreateToken(f *testing.F) {
	fc := newFuzzControl(f)
	for _, s := range bodySeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"name":"ci","scopes":["user"]}`))
	f.Add([]byte(`{"name":"ops","scopes":["admin","user"],"expires_at":"2999-01-01T00:00:00Z"}`))
	f.Add([]byte(`{"name":"old","scopes":["user"],"expires_at":"2000-01-01T00:00:00Z"}`))
	f.Add([]byte(`{"name":"x","scopes":["root"]}`))
	f.Add([]byte(`{"name":"x","scopes":["user","user"]}`))
	f.Add([]byte(`{"name":"x","scopes":[]}`))
	f.Add([]byte(`{"name":"x","scopes":"user"}`))
	f.Add([]byte(`{"name":"x","scopes":["user"],"expires_at":"tomorrow"}`))
	f.Add([]byte(`{"name":"x","scopes":["user"],"token":"kvmd_chosen"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fc.do(t, http.MethodPost, "/v1/tokens", body, nil, false)
	})
}

// validHeaderValue leaves out what net/http would refuse to send anyway.
func validHeaderValue(v string) bool {
	for _, r := range v {
		if r < ' ' || r == 0x7f || r > 0x7e {
			return false
		}
	}
	return true
}
