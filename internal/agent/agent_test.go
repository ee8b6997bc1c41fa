package agent_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const token = "test-token"

// countingDriver counts boots, so a test can prove that a retried or
// concurrent create booted one VM.
type countingDriver struct {
	*sim.Driver
	boots atomic.Int64
}

func (d *countingDriver) Boot(ctx context.Context, m *agent.Machine, o agent.BootOptions) error {
	d.boots.Add(1)
	return d.Driver.Boot(ctx, m, o)
}

type harness struct {
	dir    string
	driver *countingDriver
	agent  *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
}

func startHarness(t *testing.T, dir string, delay time.Duration) *harness {
	t.Helper()
	d := &countingDriver{Driver: sim.New(sim.Options{BootDelay: delay})}
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: dir, Driver: d, Token: token,
		Capacity: agentapi.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 100000},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	srv := httptest.NewServer(a.Handler())
	h := &harness{dir: dir, driver: d, agent: a, srv: srv,
		client: agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0))}
	t.Cleanup(func() { h.stop() })
	return h
}

func (h *harness) stop() {
	h.srv.Close()
	_ = h.agent.Close()
}

var spec = agentapi.VMSpec{Image: "sim", VCPUs: 2, MemoryMiB: 512, DiskMiB: 1024}

func statusOf(err error) int {
	var e *agentapi.Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

func TestCreateIsIdempotentOnID(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	vm, err := h.client.CreateVM(ctx, "vm-1", spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if vm.State != agentapi.StateRunning || vm.StartedFrom != agentapi.StartedCold || vm.Image != "sim" {
		t.Fatalf("created vm = %+v, want running cold sim", vm)
	}
	again, err := h.client.CreateVM(ctx, "vm-1", spec)
	if err != nil {
		t.Fatalf("second create: %v", err)
	}
	if again.CreatedAt != vm.CreatedAt || h.driver.boots.Load() != 1 {
		t.Fatalf("second create made another vm: %+v vs %+v, boots %d", again, vm, h.driver.boots.Load())
	}
	other := spec
	other.MemoryMiB = 1024
	if _, err := h.client.CreateVM(ctx, "vm-1", other); statusOf(err) != http.StatusConflict {
		t.Fatalf("create with another shape: err %v, want 409", err)
	}
}

func TestConcurrentCreatesOfOneIDBootOnce(t *testing.T) {
	h := startHarness(t, t.TempDir(), 20*time.Millisecond)
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vm, err := h.client.CreateVM(context.Background(), "same", spec)
			if err == nil && vm.State != agentapi.StateRunning {
				err = fmt.Errorf("state %s", vm.State)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("concurrent create: %v", err)
		}
	}
	if n := h.driver.boots.Load(); n != 1 {
		t.Fatalf("boots = %d, want 1", n)
	}
}

func TestManyConcurrentCreates(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	const n = 200
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h.client.CreateVM(context.Background(), fmt.Sprintf("vm-%03d", i), spec); err != nil {
				failed.Add(1)
				t.Errorf("create %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	vms, err := h.client.ListVMs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != n || failed.Load() != 0 {
		t.Fatalf("listed %d vms, %d creates failed; want %d and 0", len(vms), failed.Load(), n)
	}
	info, err := h.client.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Allocated.VCPUs != 2*n || info.VMCount != n || info.Driver != "sim" {
		t.Fatalf("info = %+v, want %d vcpus allocated, %d vms, driver sim", info, 2*n, n)
	}
}

func TestBadInputIsRejectedAndStartsNothing(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	cases := []struct {
		name, id, body, token string
		want                  int
	}{
		{"unknown image", "a", `{"image":"nope","vcpus":1,"memory_mib":64,"disk_mib":1}`, token, 400},
		{"zero memory", "a", `{"image":"sim","vcpus":1,"memory_mib":0,"disk_mib":1}`, token, 400},
		{"zero vcpus", "a", `{"image":"sim","vcpus":0,"memory_mib":64,"disk_mib":1}`, token, 400},
		{"negative disk", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":-1}`, token, 400},
		{"malformed json", "a", `{"image":"sim",`, token, 400},
		{"unknown field", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1,"cpus":3}`, token, 400},
		{"two values", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1} {}`, token, 400},
		{"bad id", "..", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1}`, token, 400},
		{"wrong token", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1}`, "wrong", 401},
		{"no token", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1}`, "", 401},
		{"too large", "a", `{"image":"` + strings.Repeat("x", 2<<20) + `"}`, token, 413},
		{"unknown firmware", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1,"firmware":"efi"}`, token, 400},
		{"secure boot under bios", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1,"firmware":"bios","secure_boot":true}`, token, 400},
		{"secure boot on a bios image", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1,"secure_boot":true}`, token, 400},
		{"uefi for a kernel image", "a", `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":1,"firmware":"uefi"}`, token, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPut, h.srv.URL+"/v1/vms/"+tc.id, strings.NewReader(tc.body))
			if tc.token != "" {
				req.Header.Set("Authorization", "Bearer "+tc.token)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = resp.Body.Close() }()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.want, b)
			}
			if !strings.Contains(string(b), `"error":{"code":"`) {
				t.Fatalf("body is not the error envelope: %s", b)
			}
		})
	}
	vms, err := h.client.ListVMs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(filepath.Join(h.dir, "vms"))
	if len(vms) != 0 || len(entries) != 0 || h.driver.boots.Load() != 0 {
		t.Fatalf("bad input left %d vms, %d dirs, %d boots", len(vms), len(entries), h.driver.boots.Load())
	}
}

func TestHealthzIsOpenAndV1IsNot(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	for path, want := range map[string]int{"/healthz": 200, "/metrics": 200, "/v1/info": 401, "/v1/vms": 401} {
		resp, err := http.Get(h.srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s = %d, want %d", path, resp.StatusCode, want)
		}
	}
}

func TestPowerActions(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVM(ctx, "p", spec); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		action, want string
		status       int
	}{
		{"pause", agentapi.StatePaused, 0},
		{"pause", agentapi.StatePaused, 0},
		{"resume", agentapi.StateRunning, 0},
		{"resume", agentapi.StateRunning, 0},
		{"stop", agentapi.StateStopped, 0},
		{"stop", agentapi.StateStopped, 0},
		{"pause", "", 409},
		{"resume", "", 409},
		{"start", agentapi.StateRunning, 0},
		{"start", agentapi.StateRunning, 0},
		{"reboot", "", 404},
	}
	for i, s := range steps {
		vm, err := h.client.Action(ctx, "p", s.action)
		if s.status != 0 {
			if statusOf(err) != s.status {
				t.Fatalf("step %d %s: err %v, want %d", i, s.action, err, s.status)
			}
			continue
		}
		if err != nil || vm.State != s.want {
			t.Fatalf("step %d %s: state %q err %v, want %s", i, s.action, vm.State, err, s.want)
		}
		got, err := h.client.GetVM(ctx, "p")
		if err != nil || got.State != s.want {
			t.Fatalf("step %d %s: GET state %q err %v, want %s", i, s.action, got.State, err, s.want)
		}
	}
	if _, err := h.client.Action(ctx, "missing", "start"); statusOf(err) != 404 {
		t.Fatalf("action on unknown vm: %v, want 404", err)
	}
}

func TestDeleteRemovesFilesAndIsIdempotent(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVM(ctx, "d", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "vms", "d", "vm.json")); err != nil {
		t.Fatalf("metadata not written: %v", err)
	}
	for i := 0; i < 2; i++ {
		if err := h.client.DeleteVM(ctx, "d"); err != nil {
			t.Fatalf("delete %d: %v", i, err)
		}
	}
	if _, err := os.Stat(filepath.Join(h.dir, "vms", "d")); !os.IsNotExist(err) {
		t.Fatalf("vm directory still there: %v", err)
	}
	if _, err := h.client.GetVM(ctx, "d"); statusOf(err) != 404 {
		t.Fatalf("get after delete: %v, want 404", err)
	}
	// The id can be used again.
	if _, err := h.client.CreateVM(ctx, "d", spec); err != nil {
		t.Fatalf("create after delete: %v", err)
	}
}

func TestRestartReadoptsAndIsolatesCorruptMetadata(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	for _, id := range []string{"run", "pause", "stop", "bad"} {
		if _, err := h.client.CreateVM(ctx, id, spec); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := h.client.Action(ctx, "pause", "pause"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Action(ctx, "stop", "stop"); err != nil {
		t.Fatal(err)
	}
	h.stop()
	badMeta := filepath.Join(dir, "vms", "bad", "vm.json")
	if err := os.WriteFile(badMeta, []byte(`{"version":1,"id":"bad","ima`), 0o600); err != nil {
		t.Fatal(err)
	}

	h2 := startHarness(t, dir, 0)
	want := map[string]string{"run": "running", "pause": "paused", "stop": "stopped", "bad": "error"}
	vms, err := h2.client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != len(want) {
		t.Fatalf("after restart: %d vms, want %d: %+v", len(vms), len(want), vms)
	}
	for _, vm := range vms {
		if vm.State != want[vm.ID] {
			t.Errorf("vm %s: state %s (%s), want %s", vm.ID, vm.State, vm.Reason, want[vm.ID])
		}
	}
	bad, err := h2.client.GetVM(ctx, "bad")
	if err != nil || !strings.Contains(bad.Reason, "corrupt") {
		t.Fatalf("corrupt vm = %+v, %v; want error with a reason", bad, err)
	}
	if _, err := os.Stat(badMeta + ".corrupt"); err != nil {
		t.Fatalf("corrupt metadata not moved aside: %v", err)
	}
	if h2.driver.boots.Load() != 0 {
		t.Fatalf("restart booted %d vms, want 0", h2.driver.boots.Load())
	}
	if _, err := h2.client.Action(ctx, "bad", "start"); statusOf(err) != 409 {
		t.Fatalf("start corrupt vm: %v, want 409", err)
	}
	if _, err := h2.client.Action(ctx, "run", "stop"); err != nil {
		t.Fatalf("other vms still served: %v", err)
	}

	// A second restart still reports the corrupt VM (from vm.json.corrupt).
	h2.stop()
	h3 := startHarness(t, dir, 0)
	if bad, err := h3.client.GetVM(ctx, "bad"); err != nil || bad.State != agentapi.StateError {
		t.Fatalf("corrupt vm after second restart = %+v, %v", bad, err)
	}
	if err := h3.client.DeleteVM(ctx, "bad"); err != nil {
		t.Fatalf("delete corrupt vm: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "vms", "bad")); !os.IsNotExist(err) {
		t.Fatalf("corrupt vm's directory still there: %v", err)
	}
}

func TestInfoAndConsole(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	if _, err := h.client.CreateVM(ctx, "c", spec); err != nil {
		t.Fatal(err)
	}
	info, err := h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Capacity.VCPUs != 8 || info.Allocated.MemoryMiB != 512 || info.Free.MemoryMiB != 8192-512 ||
		info.Accel != "sim" || len(info.Images) != 1 || info.Images[0] != "sim" {
		t.Fatalf("info = %+v", info)
	}
	con, err := h.client.Console(ctx, "c")
	if err != nil || !strings.Contains(con, "simulated") {
		t.Fatalf("console = %q, %v", con, err)
	}
	if _, err := h.client.Console(ctx, "nope"); statusOf(err) != 404 {
		t.Fatalf("console of unknown vm: %v, want 404", err)
	}
	for q, want := range map[string]int{"5": 200, "0": 400, "abc": 400, "2000000": 400} {
		req, _ := http.NewRequest(http.MethodGet, h.srv.URL+"/v1/vms/c/console?bytes="+q, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != want || (want == 200 && string(b) != "sole\n") {
			t.Errorf("console?bytes=%s: %d %q, want %d", q, resp.StatusCode, b, want)
		}
	}
}
