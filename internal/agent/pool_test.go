package agent_test

// Warm pool bookkeeping with the sim driver (docs/guides/architecture.md). The rules
// about real processes (orphans killed, user VMs untouched, a killed warm VM
// falling back to a cold boot) are proved with QEMU in
// internal/agent/qemu/pool_test.go.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// poolSpec is the shape the pool tests keep warm.
var poolSpec = agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 512}

func poolShape(size int) agentapi.PoolPut {
	return agentapi.PoolPut{Shapes: []agentapi.PoolShape{{VCPUs: poolSpec.VCPUs, MemoryMiB: poolSpec.MemoryMiB, DiskMiB: poolSpec.DiskMiB, Size: size}}}
}

// poolDriver is the sim driver with injections: resumes that fail or lie
// for chosen warm VMs, boots that block, and a log of boot events.
type poolDriver struct {
	*sim.Driver

	mu        sync.Mutex
	ready     map[string]bool // warm VMs past WaitReady: their next resume is a handover
	failNext  int             // this many handover resumes fail
	lieNext   int             // then this many "succeed" and leave the VM paused
	spoiled   []string        // the warm VMs whose resume failed or lied
	blockWarm chan struct{}   // non-nil: warm boots wait for it (or their context)
	blockUser chan struct{}   // non-nil: user boots wait for it
	events    []string
	warmNICs  map[string][]agentapi.NIC // the NICs each warm VM booted with
	inFlight  atomic.Int32
	boots     atomic.Int32
	// firmware, when set, makes the images disk images that boot with it.
	firmware string
	// bootFirmware is the firmware each VM booted with, by id.
	bootFirmware map[string]string
	// warmNices are the nice values warm boots asked for, in order.
	warmNices []int
}

func (d *poolDriver) Image(name string) (agent.Image, error) {
	img, err := d.Driver.Image(name)
	if err == nil && d.firmware != "" {
		img.Kind, img.Firmware = agent.ImageDisk, d.firmware
	}
	return img, err
}

func newPoolDriver() *poolDriver {
	return &poolDriver{Driver: sim.New(sim.Options{}), ready: map[string]bool{}}
}

func (d *poolDriver) spoil(fail, lie int) {
	d.mu.Lock()
	d.failNext, d.lieNext, d.spoiled = fail, lie, nil
	d.mu.Unlock()
}

func (d *poolDriver) spoiledIDs() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.spoiled...)
}

func isWarm(m *agent.Machine) bool { return strings.HasPrefix(m.ID, "warm-") }

func (d *poolDriver) event(e string) {
	d.mu.Lock()
	d.events = append(d.events, e)
	d.mu.Unlock()
}

func (d *poolDriver) Boot(ctx context.Context, m *agent.Machine, o agent.BootOptions) error {
	d.inFlight.Add(1)
	defer d.inFlight.Add(-1)
	d.boots.Add(1)
	d.mu.Lock()
	if d.bootFirmware == nil {
		d.bootFirmware = map[string]string{}
	}
	d.bootFirmware[m.ID] = m.Firmware
	block := d.blockUser
	kind := "user"
	if isWarm(m) {
		block, kind = d.blockWarm, "warm"
		if d.warmNICs == nil {
			d.warmNICs = map[string][]agentapi.NIC{}
		}
		d.warmNICs[m.ID] = slices.Clone(m.NICs)
		d.warmNices = append(d.warmNices, o.Nice)
	}
	d.mu.Unlock()
	d.event(kind + "-boot-start")
	defer d.event(kind + "-boot-end")
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return d.Driver.Boot(ctx, m, o)
}

// WaitReady blocks a warm boot like Boot does, so that a test can hold a
// boot in its longest phase.
func (d *poolDriver) WaitReady(ctx context.Context, m *agent.Machine) error {
	d.mu.Lock()
	block := d.blockWarm
	d.mu.Unlock()
	if block != nil {
		d.inFlight.Add(1)
		defer d.inFlight.Add(-1)
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := d.Driver.WaitReady(ctx, m); err != nil {
		return err
	}
	d.mu.Lock()
	d.ready[m.ID] = true
	d.mu.Unlock()
	return nil
}

func (d *poolDriver) Resume(ctx context.Context, m *agent.Machine) error {
	d.mu.Lock()
	handover := d.ready[m.ID]
	fail := handover && d.failNext > 0
	lie := handover && !fail && d.lieNext > 0
	switch {
	case fail:
		d.failNext--
		d.spoiled = append(d.spoiled, m.ID)
	case lie:
		d.lieNext--
		d.spoiled = append(d.spoiled, m.ID)
	}
	d.mu.Unlock()
	switch {
	case fail:
		return fmt.Errorf("injected: resume of %s fails", m.ID)
	case lie:
		return nil
	}
	return d.Driver.Resume(ctx, m)
}

// syncBuffer collects the agent's logs for a test to read.
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

type poolAgent struct {
	dir    string
	driver agent.Driver
	opts   agent.PoolOptions
	agent  *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
	logs   *syncBuffer
}

func startPoolAgent(t *testing.T, dir string, d agent.Driver, opts agent.PoolOptions) *poolAgent {
	t.Helper()
	return startPoolAgentWith(t, dir, d, opts, agentapi.Resources{VCPUs: 64, MemoryMiB: 64 << 10, DiskMiB: 1 << 20})
}

func startPoolAgentWith(t *testing.T, dir string, d agent.Driver, opts agent.PoolOptions, capacity agentapi.Resources) *poolAgent {
	t.Helper()
	logs := &syncBuffer{}
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: dir, Driver: d, Token: token, Pool: opts,
		Capacity: capacity,
		Logger:   slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	srv := httptest.NewServer(a.Handler())
	h := &poolAgent{dir: dir, driver: d, opts: opts, agent: a, srv: srv, logs: logs,
		client: agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0))}
	t.Cleanup(h.stop)
	return h
}

func (h *poolAgent) stop() {
	h.srv.Close()
	_ = h.agent.Close()
}

// restart stops the agent and starts a new one on the same state directory
// and driver, as after an agent crash or upgrade.
func (h *poolAgent) restart(t *testing.T) *poolAgent {
	t.Helper()
	h.stop()
	return startPoolAgent(t, h.dir, h.driver, h.opts)
}

// waitFor polls cond until it holds; the deadline bounds the test, it does
// not measure anything.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func poolRow(t *testing.T, c *agentapi.Client, image string) agentapi.PoolStatus {
	t.Helper()
	items, err := c.Pool(context.Background())
	if err != nil {
		t.Fatalf("GET /v1/pool: %v", err)
	}
	for _, it := range items {
		if it.Image == image && it.VCPUs == poolSpec.VCPUs && it.MemoryMiB == poolSpec.MemoryMiB && it.DiskMiB == poolSpec.DiskMiB {
			return it
		}
	}
	return agentapi.PoolStatus{}
}

func waitReady(t *testing.T, h *poolAgent, n int) {
	t.Helper()
	// The registry is written just after the status changes: wait for both.
	waitFor(t, fmt.Sprintf("%d ready warm vms", n), func() bool {
		r := poolRow(t, h.client, poolSpec.Image)
		ready := 0
		if b, err := os.ReadFile(filepath.Join(h.dir, "pool.json")); err == nil {
			var reg registry
			if json.Unmarshal(b, &reg) == nil {
				for _, e := range reg.Entries {
					if e.State == "ready" {
						ready++
					}
				}
			}
		}
		return r.Ready == n && r.Booting == 0 && ready == n
	})
}

// registry reads pool.json as the agent wrote it.
type registry struct {
	Version int `json:"version"`
	Entries []struct {
		ID    string `json:"id"`
		State string `json:"state"`
	} `json:"entries"`
}

func readRegistry(t *testing.T, dir string) registry {
	t.Helper()
	var r registry
	b, err := os.ReadFile(filepath.Join(dir, "pool.json"))
	if err != nil {
		t.Fatalf("read pool.json: %v", err)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("pool.json: %v\n%s", err, b)
	}
	return r
}

func registryIDs(t *testing.T, dir string) []string {
	var ids []string
	for _, e := range readRegistry(t, dir).Entries {
		ids = append(ids, e.ID)
	}
	return ids
}

// warmDirs lists the warm VM directories (not links) under pool/.
func warmDirs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(dir, "pool"))
	if err != nil {
		t.Fatalf("read pool directory: %v", err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "warm-") {
			out = append(out, e.Name())
		}
	}
	return out
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func TestPoolTargetsAreValidatedAndSurviveRestart(t *testing.T) {
	h := startPoolAgent(t, t.TempDir(), newPoolDriver(), agent.PoolOptions{MaxSize: 4})
	ctx := context.Background()
	bad := []struct {
		name  string
		image string
		put   agentapi.PoolPut
	}{
		{"unknown image", "nope", poolShape(1)},
		{"no vcpus", "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{{VCPUs: 0, MemoryMiB: 256, Size: 1}}}},
		{"no memory", "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{{VCPUs: 1, MemoryMiB: 0, Size: 1}}}},
		{"negative disk", "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{{VCPUs: 1, MemoryMiB: 256, DiskMiB: -1, Size: 1}}}},
		{"negative size", "sim", poolShape(-1)},
		{"size over the limit", "sim", poolShape(5)},
		{"total over the limit", "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{
			{VCPUs: 1, MemoryMiB: 256, Size: 3}, {VCPUs: 2, MemoryMiB: 256, Size: 2}}}},
		{"repeated shape", "sim", agentapi.PoolPut{Shapes: []agentapi.PoolShape{
			{VCPUs: 1, MemoryMiB: 256, Size: 1}, {VCPUs: 1, MemoryMiB: 256, Size: 1}}}},
	}
	for _, tc := range bad {
		_, err := h.client.SetPool(ctx, tc.image, tc.put)
		var e *agentapi.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != "invalid" || e.Message == "" {
			t.Errorf("%s: PUT /v1/pool/%s = %v, want 400 invalid with a message", tc.name, tc.image, err)
		}
	}
	// Unknown fields are refused, and the token is required.
	req, _ := http.NewRequest(http.MethodPut, h.srv.URL+"/v1/pool/sim", strings.NewReader(`{"shapes":[],"extra":1}`))
	req.Header.Set("Authorization", "Bearer "+token)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("PUT with an unknown field: %v %v, want 400", resp.StatusCode, err)
	}
	req, _ = http.NewRequest(http.MethodGet, h.srv.URL+"/v1/pool", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /v1/pool without a token: %v %v, want 401", resp.StatusCode, err)
	}
	if items, _ := h.client.Pool(ctx); len(items) != 0 || len(warmDirs(t, h.dir)) != 0 {
		t.Fatalf("refused PUTs changed the pool: %+v", items)
	}

	items, err := h.client.SetPool(ctx, "sim", poolShape(2))
	if err != nil || len(items) != 1 || items[0].Size != 2 || items[0].Image != "sim" {
		t.Fatalf("PUT /v1/pool/sim = %+v, %v; want one row of size 2", items, err)
	}
	waitReady(t, h, 2)
	info, err := h.client.Info(ctx)
	if err != nil || len(info.Pool) != 1 || info.Pool[0].Ready != 2 || info.Pool[0].Size != 2 {
		t.Fatalf("/v1/info pool = %+v, %v; want size 2, ready 2", info.Pool, err)
	}
	before := warmDirs(t, h.dir)

	// The targets survive a restart; the old warm VMs do not (orphans).
	h = h.restart(t)
	if r := poolRow(t, h.client, "sim"); r.Size != 2 {
		t.Fatalf("after a restart the pool target is %+v, want size 2", r)
	}
	waitReady(t, h, 2)
	for _, id := range before {
		if exists(filepath.Join(h.dir, "pool", id)) {
			t.Errorf("warm vm %s of the previous agent survived the restart", id)
		}
	}

	// An empty list empties the pool, and stays empty after a restart.
	if _, err := h.client.SetPool(ctx, "sim", agentapi.PoolPut{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pool to empty", func() bool {
		items, _ := h.client.Pool(ctx)
		return len(items) == 0 && len(warmDirs(t, h.dir)) == 0
	})
	h = h.restart(t)
	if items, _ := h.client.Pool(ctx); len(items) != 0 {
		t.Fatalf("after emptying and a restart, the pool is %+v", items)
	}
}

func TestWarmCreateHandsOverAPausedVMAndDeleteDestroysIt(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(1)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 1)
	warm := warmDirs(t, h.dir)[0]
	if st := d.Observe(ctx, &agent.Machine{ID: warm}, agentapi.StatePaused); st.State != agentapi.StatePaused {
		t.Fatalf("a ready warm vm is %s, want paused", st.State)
	}

	// A shape that does not match, and NoWarm, boot cold and leave the pool be.
	other := poolSpec
	other.MemoryMiB = 512
	for id, s := range map[string]agentapi.VMSpec{"other": other, "nowarm": {Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 512, NoWarm: true}} {
		vm, err := h.client.CreateVM(ctx, id, s)
		if err != nil || vm.StartedFrom != agentapi.StartedCold {
			t.Fatalf("create %s = %+v, %v; want a cold start", id, vm, err)
		}
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 1 {
		t.Fatalf("cold creates changed the pool: %+v", r)
	}

	vm, err := h.client.CreateVM(ctx, "w1", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm || vm.State != agentapi.StateRunning {
		t.Fatalf("create w1 = %+v, %v; want running, started warm", vm, err)
	}
	if got, err := h.client.GetVM(ctx, "w1"); err != nil || got.State != agentapi.StateRunning || got.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("GET w1 = %+v, %v", got, err)
	}
	// The warm VM became w1: its directory moved under vms/ (the pool keeps
	// a link), its metadata says warm, the registry no longer has it.
	link, err := os.Readlink(filepath.Join(h.dir, "pool", warm))
	if err != nil || link != filepath.Join("..", "vms", "w1") {
		t.Fatalf("pool/%s = %q, %v; want a link to ../vms/w1", warm, link, err)
	}
	meta, err := os.ReadFile(filepath.Join(h.dir, "vms", "w1", "vm.json"))
	if err != nil || !strings.Contains(string(meta), `"started_from": "warm"`) {
		t.Fatalf("vms/w1/vm.json = %s, %v", meta, err)
	}
	for _, id := range registryIDs(t, h.dir) {
		if id == warm {
			t.Fatalf("the registry still lists %s after it was handed out", id)
		}
	}

	// Delete destroys; the pool gets a brand-new warm VM, never w1's.
	waitReady(t, h, 1)
	if err := h.client.DeleteVM(ctx, "w1"); err != nil {
		t.Fatal(err)
	}
	if exists(filepath.Join(h.dir, "vms", "w1")) {
		t.Fatal("vms/w1 still exists after the delete")
	}
	next := warmDirs(t, h.dir)
	if len(next) != 1 || next[0] == warm {
		t.Fatalf("warm vms after the delete: %v; want one new one, never %s", next, warm)
	}
	if st := d.Observe(ctx, &agent.Machine{ID: "w1"}, agentapi.StateStopped); st.State != agentapi.StateStopped {
		t.Fatalf("the deleted vm is %s in the driver, want stopped", st.State)
	}
	vm2, err := h.client.CreateVM(ctx, "w2", poolSpec)
	if err != nil || vm2.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create w2 = %+v, %v", vm2, err)
	}
	if l, _ := os.Readlink(filepath.Join(h.dir, "pool", next[0])); l != filepath.Join("..", "vms", "w2") {
		t.Fatalf("w2 came from %q, want the new warm vm %s", l, next[0])
	}
}

func TestFailedResumeTriesTheNextThenBootsCold(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{Concurrency: 2})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)

	// The first warm VM fails to resume: the next one serves the create.
	d.spoil(1, 0)
	vm, err := h.client.CreateVM(ctx, "a", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm || vm.State != agentapi.StateRunning {
		t.Fatalf("create a = %+v, %v; want a warm start from the second warm vm", vm, err)
	}
	if sp := d.spoiledIDs(); len(sp) != 1 || exists(filepath.Join(h.dir, "pool", sp[0])) {
		t.Fatalf("the warm vm %v that failed to resume was not destroyed", sp)
	}

	// Every warm VM fails (one errs, one claims success but stays paused):
	// the create boots cold, and never reports a paused vm running.
	waitReady(t, h, 2)
	d.spoil(1, 1)
	vm, err = h.client.CreateVM(ctx, "b", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedCold || vm.State != agentapi.StateRunning {
		t.Fatalf("create b = %+v, %v; want a cold start", vm, err)
	}
	if got := d.Observe(ctx, &agent.Machine{ID: "b"}, ""); got.State != agentapi.StateRunning {
		t.Fatalf("vm b reported running but the driver has it %s", got.State)
	}
	sp := d.spoiledIDs()
	if len(sp) != 2 {
		t.Fatalf("spoiled warm vms %v, want 2 tried before the cold boot", sp)
	}
	for _, id := range sp {
		if exists(filepath.Join(h.dir, "pool", id)) {
			t.Errorf("unusable warm vm %s was not destroyed", id)
		}
		if st := d.Observe(ctx, &agent.Machine{ID: id}, agentapi.StateStopped); st.State != agentapi.StateStopped {
			t.Errorf("unusable warm vm %s is %s in the driver, want destroyed", id, st.State)
		}
	}
	waitReady(t, h, 2) // and the pool refills with new ones
}

func TestCorruptRegistryIsQuarantinedAndThePoolStartsEmpty(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	old := warmDirs(t, h.dir)
	h.stop()

	garbage := []byte(`{"version": 1, "entries": [{"id": "warm-`) // cut short by a crash
	path := filepath.Join(h.dir, "pool.json")
	if err := os.WriteFile(path, garbage, 0o600); err != nil {
		t.Fatal(err)
	}
	// Targets 0 across the restart, so that "starts empty" is visible
	// before any refill; the targets file is not the registry.
	if err := os.WriteFile(filepath.Join(h.dir, "pool-targets.json"), []byte(`{"version":1,"targets":[]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	h = startPoolAgent(t, h.dir, d, agent.PoolOptions{})
	moved, err := os.ReadFile(path + ".corrupt")
	if err != nil || !bytes.Equal(moved, garbage) {
		t.Fatalf("pool.json.corrupt = %q, %v; want the corrupt file moved aside", moved, err)
	}
	if r := readRegistry(t, h.dir); r.Version != 1 || len(r.Entries) != 0 {
		t.Fatalf("new registry = %+v, want empty", r)
	}
	if items, _ := h.client.Pool(ctx); len(items) != 0 {
		t.Fatalf("pool after a corrupt registry = %+v, want empty", items)
	}
	// The warm VMs the file named are not handed out: they are destroyed.
	if dirs := warmDirs(t, h.dir); len(dirs) != 0 {
		t.Fatalf("warm vms %v (of %v) survived a corrupt registry", dirs, old)
	}
	vm, err := h.client.CreateVM(ctx, "c", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedCold {
		t.Fatalf("create after a corrupt registry = %+v, %v; want cold", vm, err)
	}
	if !strings.Contains(h.logs.String(), "corrupt pool file moved aside") {
		t.Fatalf("no log line about the corrupt registry:\n%s", h.logs.String())
	}
}

func TestBadRegistryEntryDropsOnlyThatEntry(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.CreateVM(ctx, "user", agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 128, NoWarm: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.SetPool(ctx, "sim", poolShape(3)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 3)
	h.stop()

	// Entry 0 stays good; entry 1 gets a broken shape (its id is usable);
	// entry 2 gets an id that points at the user's vm (not usable: never
	// followed); entry 3 is not even an object.
	path := filepath.Join(h.dir, "pool.json")
	var f struct {
		Version int              `json:"version"`
		Entries []map[string]any `json:"entries"`
	}
	b, _ := os.ReadFile(path)
	if err := json.Unmarshal(b, &f); err != nil || len(f.Entries) != 3 {
		t.Fatalf("pool.json = %s, %v", b, err)
	}
	good, broken, hijacked := f.Entries[0]["id"].(string), f.Entries[1]["id"].(string), f.Entries[2]["id"].(string)
	f.Entries[1]["vcpus"] = "two"
	f.Entries[2]["id"] = "../vms/user"
	raw, _ := json.Marshal(f)
	raw = bytes.Replace(raw, []byte(`]}`), []byte(`,42]}`), 1)
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}

	h = startPoolAgent(t, h.dir, d, agent.PoolOptions{})
	if exists(path + ".corrupt") {
		t.Fatal("bad entries quarantined the whole registry")
	}
	for _, id := range []string{good, broken, hijacked} {
		if exists(filepath.Join(h.dir, "pool", id)) {
			t.Errorf("warm vm %s survived the restart", id)
		}
	}
	if vm, err := h.client.GetVM(ctx, "user"); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("the user's vm after a registry entry pointed at it: %+v, %v", vm, err)
	}
	if !exists(filepath.Join(h.dir, "vms", "user", "vm.json")) {
		t.Fatal("the user's vm directory was touched by a bad registry entry")
	}
	logs := h.logs.String()
	if n := strings.Count(logs, "bad pool registry entry dropped"); n != 3 {
		t.Fatalf("%d bad entries logged, want 3:\n%s", n, logs)
	}
	if !strings.Contains(logs, `"warm_vm":"`+good+`","found":"in the registry"`) {
		t.Fatalf("the good entry %s was not reconciled from the registry:\n%s", good, logs)
	}
	if !strings.Contains(logs, `"warm_vm":"`+broken+`","found":"in a bad registry entry"`) {
		t.Fatalf("the broken entry %s was not destroyed by its id:\n%s", broken, logs)
	}
	waitReady(t, h, 3) // the targets refill the pool
}

// breakRegistryWrites makes writes in dir fail: chmod, which stops anyone
// but root; then chattr +i, which stops root where the filesystem has it;
// else pool.json becomes a directory, so that the rename over it fails.
func breakRegistryWrites(t *testing.T, dir string) string {
	t.Helper()
	writable := func() bool {
		f, err := os.CreateTemp(dir, "probe-*")
		if err != nil {
			return false
		}
		_ = f.Close()
		_ = os.Remove(f.Name())
		return true
	}
	if err := os.Chmod(dir, 0o555); err == nil {
		if !writable() {
			t.Cleanup(func() { _ = os.Chmod(dir, 0o755) })
			return "chmod 0555"
		}
		_ = os.Chmod(dir, 0o755)
	}
	if exec.Command("chattr", "+i", dir).Run() == nil {
		if !writable() {
			t.Cleanup(func() { _ = exec.Command("chattr", "-i", dir).Run() })
			return "chattr +i"
		}
		_ = exec.Command("chattr", "-i", dir).Run()
	}
	path := filepath.Join(dir, "pool.json")
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(path, "blocker"), 0o755); err != nil {
		t.Fatal(err)
	}
	return "pool.json is a directory"
}

func TestRegistryWriteFailureDoesNotFailTheCreate(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(1)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 1)
	warm := warmDirs(t, h.dir)[0]
	how := breakRegistryWrites(t, h.dir)
	t.Logf("registry writes broken by: %s", how)

	vm, err := h.client.CreateVM(ctx, "ro", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm || vm.State != agentapi.StateRunning {
		t.Fatalf("create with an unwritable registry = %+v, %v; want a warm start", vm, err)
	}
	if !strings.Contains(h.logs.String(), "write the pool registry") {
		t.Fatalf("the failed registry write was not logged:\n%s", h.logs.String())
	}
	if how != "pool.json is a directory" {
		// The file on disk is stale: it still lists the handed-out vm.
		if ids := registryIDs(t, h.dir); len(ids) != 1 || ids[0] != warm {
			t.Fatalf("registry on disk = %v, want the stale [%s]", ids, warm)
		}
	}

	// A restart on the stale registry never takes the vm back from its user.
	h.stop()
	_ = os.Chmod(h.dir, 0o755)
	_ = exec.Command("chattr", "-i", h.dir).Run()
	if fi, err := os.Stat(filepath.Join(h.dir, "pool.json")); err == nil && fi.IsDir() {
		_ = os.RemoveAll(filepath.Join(h.dir, "pool.json"))
	}
	h = startPoolAgent(t, h.dir, d, agent.PoolOptions{})
	if got, err := h.client.GetVM(ctx, "ro"); err != nil || got.State != agentapi.StateRunning || got.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("vm ro after a restart on a stale registry: %+v, %v", got, err)
	}
	if !exists(filepath.Join(h.dir, "vms", "ro", "vm.json")) {
		t.Fatal("the handed-out vm's files were removed")
	}
}

func TestCloseStopsTheFillerAndItsBoots(t *testing.T) {
	d := newPoolDriver()
	d.blockWarm = make(chan struct{}) // never released: boots end only by Close
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a warm boot to start", func() bool { return d.inFlight.Load() == 1 })
	if r := poolRow(t, h.client, "sim"); r.Booting != 1 || r.Ready != 0 {
		t.Fatalf("with concurrency 1, the pool is %+v; want one booting", r)
	}
	h.srv.Close()
	if err := h.agent.Close(); err != nil {
		t.Fatal(err)
	}
	// Close returned: the boot it interrupted has ended and cleaned up.
	if n := d.inFlight.Load(); n != 0 {
		t.Fatalf("%d warm boots still run after Close", n)
	}
	boots := d.boots.Load()
	if dirs := warmDirs(t, h.dir); len(dirs) != 0 {
		t.Fatalf("the interrupted warm boot left %v", dirs)
	}
	if ids := registryIDs(t, h.dir); len(ids) != 0 {
		t.Fatalf("registry after Close = %v, want empty", ids)
	}
	if err := h.agent.Close(); err != nil { // twice is fine
		t.Fatal(err)
	}
	if n := d.boots.Load(); n != boots {
		t.Fatalf("boots went from %d to %d after Close", boots, n)
	}
}

func TestFillerWaitsForUserCreates(t *testing.T) {
	d := newPoolDriver()
	d.blockUser = make(chan struct{})
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	created := make(chan error, 1)
	go func() {
		_, err := h.client.CreateVM(ctx, "user", agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 128})
		created <- err
	}()
	waitFor(t, "the user boot to start", func() bool { return d.inFlight.Load() == 1 })
	if _, err := h.client.SetPool(ctx, "sim", poolShape(1)); err != nil {
		t.Fatal(err)
	}
	// The filler had this long to (wrongly) start a warm boot beside the
	// user's; a correct one waits however long the user boot takes.
	time.Sleep(200 * time.Millisecond)
	close(d.blockUser)
	if err := <-created; err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 1)
	d.mu.Lock()
	events := strings.Join(d.events, " ")
	d.mu.Unlock()
	if !strings.HasPrefix(events, "user-boot-start user-boot-end warm-boot-start") {
		t.Fatalf("boot order %q: a warm boot started while the user's booted", events)
	}
}

// TestRefillWaitsForQuiet: a burst of creates takes warm VMs without any
// replacement booting between them; the pool refills once creates paused
// for RefillQuiet, at the pool's low priority, to its full size.
func TestRefillWaitsForQuiet(t *testing.T) {
	for _, tc := range []struct {
		name   string
		quiet  time.Duration
		refill bool
	}{{"long quiet", time.Hour, false}, {"short quiet", 2 * time.Second, true}} {
		t.Run(tc.name, func(t *testing.T) {
			d := newPoolDriver()
			h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{RefillQuiet: tc.quiet, Concurrency: 3})
			ctx := context.Background()
			if _, err := h.client.SetPool(ctx, "sim", poolShape(3)); err != nil {
				t.Fatal(err)
			}
			waitReady(t, h, 3)
			boots := d.boots.Load()
			for i := range 3 {
				vm, err := h.client.CreateVM(ctx, fmt.Sprintf("burst-%d", i), poolSpec)
				if err != nil || vm.StartedFrom != agentapi.StartedWarm {
					t.Fatalf("create burst-%d = %+v, %v; want warm", i, vm, err)
				}
				// The next create of the burst follows at once: a refill
				// that started now would compete with it.
				if n := d.boots.Load(); n != boots {
					t.Fatalf("a warm boot started within the burst, after create %d", i)
				}
			}
			if !tc.refill {
				// The filler's wake-ups after each create have come and gone.
				time.Sleep(300 * time.Millisecond)
				if r := poolRow(t, h.client, "sim"); r.Ready+r.Booting != 0 || d.boots.Load() != boots {
					t.Fatalf("pool %+v, %d boots since the burst: refilled before creates paused for %s",
						r, d.boots.Load()-boots, tc.quiet)
				}
				return
			}
			waitReady(t, h, 3)
			d.mu.Lock()
			nices := slices.Clone(d.warmNices)
			d.mu.Unlock()
			for _, n := range nices[len(nices)-3:] {
				if n != 10 {
					t.Fatalf("warm boots asked for nice values %v, want 10 (the pool's default, below user vms)", nices)
				}
			}
		})
	}
}

// TestWarmVMsBootWithAUserNICAndServeCreatesOfThatNIC: warm VMs boot with
// one user-mode NIC (a MAC of their own, no forwards); a create asking for
// exactly one user-mode NIC without forwards takes one and reports the MAC
// the warm VM booted with, and a retried create still matches; a create
// with forwards or more NICs boots cold.
func TestWarmVMsBootWithAUserNICAndServeCreatesOfThatNIC(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	d.mu.Lock()
	booted := map[string]string{} // MAC -> warm VM
	for id, nics := range d.warmNICs {
		if len(nics) != 1 || nics[0].Mode != agentapi.NetworkUser || len(nics[0].PortForwards) != 0 {
			t.Errorf("warm vm %s booted with NICs %+v; want one user-mode NIC without forwards", id, nics)
			continue
		}
		booted[nics[0].MACAddress] = id
	}
	d.mu.Unlock()
	if len(booted) != 2 {
		t.Fatalf("warm vms booted with MACs %v; want two distinct ones", booted)
	}

	user := func(mac string, forwards ...int) agentapi.NIC {
		n := agentapi.NIC{Network: "lab", Mode: agentapi.NetworkUser, MACAddress: mac}
		for _, p := range forwards {
			n.PortForwards = append(n.PortForwards, agentapi.PortForward{GuestPort: p})
		}
		return n
	}
	withNICs := func(nics ...agentapi.NIC) agentapi.VMSpec {
		s := poolSpec
		s.NICs = nics
		return s
	}
	for id, s := range map[string]agentapi.VMSpec{
		"forwards": withNICs(user("02:00:00:00:00:01", 22)),
		"two":      withNICs(user("02:00:00:00:00:02"), user("02:00:00:00:00:03")),
	} {
		vm, err := h.client.CreateVM(ctx, id, s)
		if err != nil || vm.StartedFrom != agentapi.StartedCold {
			t.Fatalf("create %s = %+v, %v; want a cold start", id, vm, err)
		}
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 2 {
		t.Fatalf("cold creates changed the pool: %+v", r)
	}

	spec := withNICs(user("02:00:00:00:00:10"))
	vm, err := h.client.CreateVM(ctx, "u1", spec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create u1 = %+v, %v; want a warm start", vm, err)
	}
	if len(vm.NICs) != 1 || vm.NICs[0].Network != "lab" || vm.NICs[0].Mode != agentapi.NetworkUser {
		t.Fatalf("u1 NICs = %+v; want its one user-mode NIC on lab", vm.NICs)
	}
	mac := vm.NICs[0].MACAddress
	if _, ok := booted[mac]; !ok {
		t.Fatalf("u1 reports MAC %s; want the MAC its warm vm booted with (one of %v)", mac, booted)
	}
	if !strings.HasPrefix(mac, "06:") {
		t.Errorf("warm MAC %s: want the 06: prefix that control-derived MACs (02:) never have", mac)
	}
	again, err := h.client.CreateVM(ctx, "u1", spec)
	if err != nil || again.NICs[0].MACAddress != mac || again.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("retried create of u1 = %+v, %v; want the same warm vm with MAC %s", again, err, mac)
	}
	got, err := h.client.GetVM(ctx, "u1")
	if err != nil || len(got.NICs) != 1 || got.NICs[0].MACAddress != mac {
		t.Fatalf("GET u1 = %+v, %v; want MAC %s", got, err, mac)
	}
	vm2, err := h.client.CreateVM(ctx, "u2", withNICs(user("02:00:00:00:00:11")))
	if err != nil || vm2.StartedFrom != agentapi.StartedWarm || vm2.NICs[0].MACAddress == mac {
		t.Fatalf("create u2 = %+v, %v; want a warm start with a MAC other than %s", vm2, err, mac)
	}
}

// TestWarmVMsAreEvictedToMakeRoomForAUserVM: a host of 1024 MiB keeps two
// warm VMs of 256 MiB; a cold create of 768 MiB (another shape) would make
// user VMs and warm VMs take 1280 MiB. The oldest warm VMs are evicted
// until both fit, the create succeeds, the host's info counts the pool, and
// the filler does not boot the evicted VMs back while there is no room.
func TestWarmVMsAreEvictedToMakeRoomForAUserVM(t *testing.T) {
	d := newPoolDriver()
	capacity := agentapi.Resources{VCPUs: 8, MemoryMiB: 1024, DiskMiB: 1 << 20}
	h := startPoolAgentWith(t, t.TempDir(), d, agent.PoolOptions{}, capacity)
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	info, err := h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Warm.MemoryMiB != 512 || info.Free.MemoryMiB != 512 {
		t.Fatalf("info with two warm vms: warm %+v free %+v; want 512 MiB warm and 512 MiB free", info.Warm, info.Free)
	}

	big := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 768, DiskMiB: 512}
	vm, err := h.client.CreateVM(ctx, "big", big)
	if err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("create big = %+v, %v; want running", vm, err)
	}
	info, err = h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if used := info.Allocated.MemoryMiB + info.Warm.MemoryMiB; used > capacity.MemoryMiB {
		t.Fatalf("user vms %d MiB + warm vms %d MiB = %d MiB on a host of %d MiB",
			info.Allocated.MemoryMiB, info.Warm.MemoryMiB, used, capacity.MemoryMiB)
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 1 || r.Booting != 0 {
		t.Fatalf("pool after the create: %+v; want the one warm vm that still fits", r)
	}
	if !strings.Contains(h.logs.String(), "warm vm evicted to make room for a vm") {
		t.Errorf("the eviction is not logged:\n%s", h.logs.String())
	}
	// The evicted warm VM is destroyed, not kept aside.
	waitFor(t, "one warm vm directory", func() bool { return len(warmDirs(t, h.dir)) == 1 })
}

// TestWarmVMsStayWithinTheControlPlanesCapacity: the control plane places
// by less than the agent has (memory reserved for the host) and says so
// with each create (host_capacity); the warm pool keeps within that too.
// A host of 2048 MiB placed as 1536 MiB keeps two warm VMs of 256 MiB; a
// create of 1280 MiB would make 1792 MiB, within the host but over what
// the control plane places by: one warm VM is evicted, none booted back.
func TestWarmVMsStayWithinTheControlPlanesCapacity(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgentWith(t, t.TempDir(), d, agent.PoolOptions{}, agentapi.Resources{VCPUs: 8, MemoryMiB: 2048, DiskMiB: 1 << 20})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 1280, DiskMiB: 512,
		HostCapacity: &agentapi.Resources{VCPUs: 8, MemoryMiB: 1536, DiskMiB: 1 << 20}}
	if _, err := h.client.CreateVM(ctx, "placed", spec); err != nil {
		t.Fatal(err)
	}
	info, err := h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if used := info.Allocated.MemoryMiB + info.Warm.MemoryMiB; used > 1536 {
		t.Fatalf("vms %d MiB + warm vms %d MiB = %d MiB, over the 1536 MiB the control plane places by",
			info.Allocated.MemoryMiB, info.Warm.MemoryMiB, used)
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 1 || r.Booting != 0 {
		t.Fatalf("pool after the create: %+v; want one warm vm left and none booting", r)
	}
}

// The firmware is part of a warm VM's shape: warm VMs boot with their
// image's firmware, and serve only creates that boot with it; a create
// with another firmware, or with Secure Boot, boots cold and leaves the
// pool be.
func TestWarmVMsServeOnlyCreatesOfTheirFirmware(t *testing.T) {
	d := newPoolDriver()
	d.firmware = agentapi.FirmwareUEFI
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(1)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 1)
	warm := warmDirs(t, h.dir)[0]
	d.mu.Lock()
	warmFW := d.bootFirmware[warm]
	d.mu.Unlock()
	if warmFW != agentapi.FirmwareUEFI {
		t.Fatalf("warm vm %s booted with firmware %q, want its image's uefi", warm, warmFW)
	}
	bios := poolSpec
	bios.Firmware = agentapi.FirmwareBIOS
	secure := poolSpec
	secure.SecureBoot = true
	for id, s := range map[string]agentapi.VMSpec{"bios": bios, "secure": secure} {
		vm, err := h.client.CreateVM(ctx, id, s)
		if err != nil || vm.StartedFrom != agentapi.StartedCold {
			t.Fatalf("create %s = %+v, %v; want a cold start", id, vm, err)
		}
		if vm.Firmware != map[string]string{"bios": "bios", "secure": "uefi"}[id] || vm.SecureBoot != (id == "secure") {
			t.Fatalf("create %s: firmware %q secure boot %v", id, vm.Firmware, vm.SecureBoot)
		}
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 1 {
		t.Fatalf("creates of another firmware took from the pool: %+v", r)
	}
	vm, err := h.client.CreateVM(ctx, "w1", poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm || vm.Firmware != agentapi.FirmwareUEFI {
		t.Fatalf("create w1 = %+v, %v; want started warm, firmware uefi", vm, err)
	}
}
