package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

type rawResponse struct {
	status int
	body   []byte
	env    api.ErrorBody
}

func send(t *testing.T, c *testenv.Control, method, path, auth string, body io.Reader, header map[string]string) rawResponse {
	t.Helper()
	req, err := http.NewRequest(method, c.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	r := rawResponse{status: resp.StatusCode, body: b}
	_ = json.Unmarshal(b, &r.env)
	return r
}

func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	bearer := "Bearer " + c.Token
	valid := `{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024}`
	huge := `{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024,"labels":{"pad":"` + strings.Repeat("x", 1<<20) + `"}}`
	tests := []struct {
		name       string
		method     string
		path       string
		auth       string
		body       io.Reader
		wantStatus int
		wantCode   string
		wantMsg    string
	}{
		{"malformed json", "POST", "/v1/vms", bearer, strings.NewReader(`{"name": "vm1",`), 400, "invalid", "malformed JSON"},
		{"not json", "POST", "/v1/vms", bearer, strings.NewReader(`name=vm1`), 400, "invalid", "malformed JSON at byte 2"},
		{"empty body", "POST", "/v1/vms", bearer, strings.NewReader(``), 400, "invalid", "request body is empty"},
		{"trailing data", "POST", "/v1/vms", bearer, strings.NewReader(valid + valid), 400, "invalid", "data after the JSON object"},
		{"unknown field", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024,"cpus":4}`), 400, "invalid", `unknown field "cpus"`},
		{"wrong type", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":"two","memory_mib":512,"disk_mib":1024}`), 400, "invalid", `field "vcpus" must be a number`},
		{"zero vcpus", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":0,"memory_mib":512,"disk_mib":1024}`), 400, "invalid", "vcpus must be between 1 and 255, got 0"},
		{"negative memory", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":-512,"disk_mib":1024}`), 400, "invalid", "memory_mib must be between 1 and"},
		{"missing disk", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512}`), 400, "invalid", "disk_mib must be between 1 and"},
		{"huge vcpus", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":100000,"memory_mib":512,"disk_mib":1024}`), 400, "invalid", "vcpus must be between 1 and 255, got 100000"},
		{"huge memory", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":999999999999,"disk_mib":1024}`), 400, "invalid", "memory_mib must be between 1 and 16777216"},
		{"number overflow", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1e30,"memory_mib":512,"disk_mib":1024}`), 400, "invalid", `field "vcpus" must be a whole number within range`},
		{"bad name", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"bad name!","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024}`), 400, "invalid", `name "bad name!" is not valid`},
		{"bad power state", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024,"power_state":"off"}`), 400, "invalid", `power_state must be "running" or "stopped"`},
		{"unknown image", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"nope","vcpus":1,"memory_mib":512,"disk_mib":1024}`), 400, "invalid", `image "nope" is not offered by any registered host`},
		{"unknown pinned host", "POST", "/v1/vms", bearer, strings.NewReader(`{"name":"vm1","image":"sim","vcpus":1,"memory_mib":512,"disk_mib":1024,"host":"h9"}`), 400, "invalid", `host "h9" is not registered`},
		{"body over 1 MiB", "POST", "/v1/vms", bearer, strings.NewReader(huge), 413, "too_large", "larger than 1 MiB"},
		{"chunked body over 1 MiB", "POST", "/v1/vms", bearer, io.MultiReader(strings.NewReader(huge)), 413, "too_large", "larger than 1 MiB"},
		{"missing token", "POST", "/v1/vms", "", strings.NewReader(valid), 401, "unauthorized", "unauthorized"},
		{"wrong token", "POST", "/v1/vms", "Bearer nope", strings.NewReader(valid), 401, "unauthorized", "unauthorized"},
		{"token without scheme", "GET", "/v1/vms", c.Token, nil, 401, "unauthorized", "unauthorized"},
		{"host with bad address", "PUT", "/v1/hosts/h2", bearer, strings.NewReader(`{"address":"no-port"}`), 400, "invalid", `address "no-port": want http://host:port or https://host:port`},
		{"host address with a path", "PUT", "/v1/hosts/h2", bearer, strings.NewReader(`{"address":"http://127.0.0.1:1/x?y="}`), 400, "invalid", "a path is not allowed"},
		{"host with bad ratio", "PUT", "/v1/hosts/h2", bearer, strings.NewReader(`{"address":"http://127.0.0.1:1","cpu_allocation_ratio":0}`), 400, "invalid", "cpu_allocation_ratio must be above 0"},
		{"host whose agent is down", "PUT", "/v1/hosts/h2", bearer, strings.NewReader(`{"address":"http://127.0.0.1:1"}`), 503, "unavailable", "the address http://127.0.0.1:1 did not answer the identity challenge"},
		{"bad page size", "GET", "/v1/vms?page_size=abc", bearer, nil, 400, "invalid", "page_size must be a whole number"},
		{"page size too big", "GET", "/v1/vms?page_size=5000", bearer, nil, 400, "invalid", "page_size must be between 1 and 1000"},
		{"bad page token", "GET", "/v1/vms?page_token=%21%21", bearer, nil, 400, "invalid", "page_token"},
		{"bad label filter", "GET", "/v1/vms?label=team", bearer, nil, 400, "invalid", "must be key=value"},
		{"unknown route", "GET", "/v1/nothing", bearer, nil, 404, "no_route", "no such route"},
		{"unknown vm", "GET", "/v1/vms/nope", bearer, nil, 404, "not_found", "vm nope"},
		{"bad patch", "PATCH", "/v1/vms/nope", bearer, strings.NewReader(`{"power_state":"paused"}`), 400, "invalid", "power_state must be"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := send(t, c, tt.method, tt.path, tt.auth, tt.body, map[string]string{"Idempotency-Key": "key-of-refused-requests"})
			if r.status != tt.wantStatus || r.env.Error.Code != tt.wantCode || !strings.Contains(r.env.Error.Message, tt.wantMsg) {
				t.Errorf("got %d %s; want %d %s with %q", r.status, r.body, tt.wantStatus, tt.wantCode, tt.wantMsg)
			}
			if r.status == 401 && strings.TrimSpace(string(r.body)) != `{"error":{"code":"unauthorized","message":"unauthorized"}}` {
				t.Errorf("401 must say nothing more: %s", r.body)
			}
		})
	}

	ctx := context.Background()
	if vms, err := c.Client.AllVMs(ctx, client.ListOptions{}); err != nil || len(vms) != 0 {
		t.Errorf("refused requests wrote VMs: %+v %v", vms, err)
	}
	hosts, _ := c.Client.AllHosts(ctx)
	if len(hosts) != 1 || hosts[0].Allocated != (api.Resources{}) {
		t.Errorf("refused requests changed hosts: %+v", hosts)
	}
	// The key of the refused requests was never stored: a valid request
	// with it creates a VM instead of answering 422.
	r := send(t, c, "POST", "/v1/vms", bearer, strings.NewReader(valid), map[string]string{"Idempotency-Key": "key-of-refused-requests"})
	if r.status != http.StatusCreated {
		t.Errorf("valid create with the refused requests' key: %d %s", r.status, r.body)
	}
}

func TestProbesMetricsAndRequestIDs(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "m", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, ""); err != nil {
		t.Fatal(err)
	}
	// kvmd_vms counts what the host monitor's rounds read.
	c.Service.SyncNow(ctx)
	for _, path := range []string{"/healthz", "/readyz"} {
		if r := send(t, c, "GET", path, "", nil, nil); r.status != 200 {
			t.Errorf("%s: %d %s", path, r.status, r.body)
		}
	}
	r := send(t, c, "GET", "/metrics", "", nil, nil)
	for _, want := range []string{
		`kvmd_placements_total{result="placed"} 1`,
		"kvmd_placement_duration_seconds_count 1",
		"kvmd_reservation_conflicts_total 0",
		`kvmd_agent_call_duration_seconds_count{op="create_vm"} 1`,
		`kvmd_agent_call_errors_total{op="info"} 0`,
		`kvmd_vms{state="running"} 1`,
		`kvmd_http_requests_total{code="Created",method="POST",route="/v1/vms"} 1`,
	} {
		if !bytes.Contains(r.body, []byte(want)) {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	req, _ := http.NewRequest("GET", c.URL+"/v1/hosts", nil)
	req.Header.Set("Authorization", "Bearer "+c.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("responses must carry a request id")
	}

	_ = c.Store.Close()
	if r := send(t, c, "GET", "/readyz", "", nil, nil); r.status != 503 || r.env.Error.Code != "unavailable" {
		t.Errorf("/readyz with the database closed: %d %s", r.status, r.body)
	}
}
