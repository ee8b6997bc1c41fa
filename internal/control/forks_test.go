package control_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// forkHost is a sim agent behind a proxy that counts the snapshot PUTs that
// really created a snapshot (201) and the VM PUTs per id.
type forkHost struct {
	name    string
	agent   *testenv.Agent
	address string // the proxy's, which the host registers with

	snapshotsCreated atomic.Int64
	mu               sync.Mutex
	vmPuts           map[string]int
}

func startForkHost(t *testing.T, name string, memoryMiB int64) *forkHost {
	t.Helper()
	h := &forkHost{name: name, vmPuts: map[string]int{}}
	h.agent = testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 64, MemoryMiB: memoryMiB, DiskMiB: 1 << 20})
	target, err := url.Parse(h.agent.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = func(r *http.Response) error {
		req := r.Request
		if req.Method != http.MethodPut {
			return nil
		}
		switch {
		case strings.HasPrefix(req.URL.Path, "/v1/snapshots/") && r.StatusCode == http.StatusCreated:
			h.snapshotsCreated.Add(1)
		case strings.HasPrefix(req.URL.Path, "/v1/vms/") && r.StatusCode < 300:
			h.mu.Lock()
			h.vmPuts[strings.TrimPrefix(req.URL.Path, "/v1/vms/")]++
			h.mu.Unlock()
		}
		return nil
	}
	// The agent's answer is counted even when the caller went away (a
	// stopped control API): the agent did the work all the same.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxy.ServeHTTP(w, r.WithContext(context.WithoutCancel(r.Context())))
	}))
	t.Cleanup(srv.Close)
	h.address = srv.URL
	h.agent.AllowAddress(t, srv.URL)
	return h
}

func (h *forkHost) puts(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.vmPuts[id]
}

// snapshotDirs lists the snapshots the agent keeps on disk (finished ones;
// leftovers of interrupted work start with a dot).
func (h *forkHost) snapshotDirs(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(h.agent.StateDir, "snapshots"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") {
			out = append(out, e.Name())
		}
	}
	return out
}

type forkEnv struct {
	dbURL   string
	dataDir string
	c       *testenv.Control
	hosts   []*forkHost
	source  api.VM
}

// startForkEnv starts a control API with two sim hosts (h1 with
// h1MemoryMiB, h2 roomy) and a running source VM on h1.
func startForkEnv(t *testing.T, dbURL string, h1MemoryMiB int64, hooks *control.Hooks) *forkEnv {
	t.Helper()
	e := &forkEnv{dbURL: dbURL}
	if dbURL == "" {
		e.dataDir = t.TempDir()
	}
	e.c = testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: e.dataDir, Hooks: hooks})
	e.hosts = []*forkHost{startForkHost(t, "h1", h1MemoryMiB), startForkHost(t, "h2", 64<<10)}
	for _, h := range e.hosts {
		e.c.RegisterHost(t, h.name, h.address)
	}
	in := smallVM("source")
	in.Host = "h1"
	src, err := e.c.Client.CreateVM(ctxT(t), in, "")
	if err != nil {
		t.Fatal(err)
	}
	e.source = src
	return e
}

// restart stops the control API and starts another on the same database
// (its host monitor resumes unfinished forks).
func (e *forkEnv) restart(t *testing.T, hooks *control.Hooks) {
	t.Helper()
	e.c.Stop()
	e.c = testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: e.dbURL, DataDir: e.dataDir, Hooks: hooks})
}

func (e *forkEnv) snapshotsCreated() int64 {
	var n int64
	for _, h := range e.hosts {
		n += h.snapshotsCreated.Load()
	}
	return n
}

// checkFork asserts the invariants of docs/guides/architecture.md for a fork that
// should have `count` children: exactly one snapshot ever taken, every
// child running from a snapshot under its fixed name, no leaked capacity,
// and no VM on any agent that the database does not know (nor the reverse).
func (e *forkEnv) checkFork(t *testing.T, forkID string, count int) api.Fork {
	t.Helper()
	ctx := ctxT(t)
	f, err := e.c.Client.GetFork(ctx, forkID)
	if err != nil {
		t.Fatal(err)
	}
	if f.Phase != api.ForkReady || !f.SnapshotTaken || f.SnapshotID != forkID {
		t.Errorf("fork = phase %s, snapshot_taken %v, snapshot_id %s (error %q); want ready with snapshot %s",
			f.Phase, f.SnapshotTaken, f.SnapshotID, f.Error, forkID)
	}
	if got := e.snapshotsCreated(); got != 1 {
		t.Errorf("agents created %d snapshots, want exactly 1", got)
	}
	if len(f.Children) != count {
		t.Fatalf("fork has %d children, want %d: %+v", len(f.Children), count, f.Children)
	}
	for i, ch := range f.Children {
		if want := fmt.Sprintf("%s-%d", forkID, i); ch.Name != want {
			t.Errorf("child %d is named %s, want %s", i, ch.Name, want)
		}
		if ch.ObservedState != api.StateRunning || ch.StartedFrom != agentapi.StartedSnapshot || ch.ForkID != forkID {
			t.Errorf("child %s: state %s, started_from %s, fork_id %s; want running from the snapshot of %s",
				ch.Name, ch.ObservedState, ch.StartedFrom, ch.ForkID, forkID)
		}
	}
	// Every snapshot on any host is this fork's: children can only come from it.
	for _, h := range e.hosts {
		for _, d := range h.snapshotDirs(t) {
			if d != forkID {
				t.Errorf("host %s holds snapshot %s, not the fork's %s", h.name, d, forkID)
			}
		}
	}
	checkLedger(t, e.c.Store)
	e.checkNoOrphans(t)
	return f
}

// checkNoOrphans asserts that each agent runs exactly the VMs whose rows
// place them on its host.
func (e *forkEnv) checkNoOrphans(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	for _, h := range e.hosts {
		onAgent, err := h.agent.Client.ListVMs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var agentIDs []string
		for _, v := range onAgent {
			agentIDs = append(agentIDs, v.ID)
		}
		rows, err := e.c.Store.ListVMs(ctx, store.VMFilter{Host: h.name})
		if err != nil {
			t.Fatal(err)
		}
		var rowIDs []string
		for _, r := range rows {
			rowIDs = append(rowIDs, r.ID)
		}
		slices.Sort(agentIDs)
		slices.Sort(rowIDs)
		if !slices.Equal(agentIDs, rowIDs) {
			t.Errorf("host %s: agent runs %v but the database places %v there", h.name, agentIDs, rowIDs)
		}
	}
}

func forkErrorID(t *testing.T, err error) string {
	t.Helper()
	var e *client.Error
	if !errors.As(err, &e) {
		t.Fatalf("fork error %v is not an API error", err)
	}
	id, _ := e.Details["fork_id"].(string)
	return id
}

// once returns a ForkStep hook that fails the first time step (and slot,
// unless it is -1 for any) is reached, with err.
func once(step string, slot int, err error) func(context.Context, string, string, int) error {
	var fired atomic.Bool
	return func(_ context.Context, _ string, s string, sl int) error {
		if s == step && (slot < 0 || sl == slot) && fired.CompareAndSwap(false, true) {
			return err
		}
		return nil
	}
}

func TestForkColocateSpillsToAnotherHostThatPullsTheSnapshot(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		// h1 takes the source and two children of 1 GiB; the others spill.
		e := startForkEnv(t, dbURL, 3072, nil)
		f, err := e.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: e.source.ID, Count: 4, Placement: api.PlacementColocate}, "")
		if err != nil {
			t.Fatal(err)
		}
		f = e.checkFork(t, f.ID, 4)
		var hosts []string
		for _, ch := range f.Children {
			hosts = append(hosts, ch.Host)
		}
		if !slices.Equal(hosts, []string{"h1", "h1", "h2", "h2"}) {
			t.Errorf("children on %v, want the source host filled first, then h2", hosts)
		}
		for _, h := range e.hosts {
			if d := h.snapshotDirs(t); !slices.Equal(d, []string{f.ID}) {
				t.Errorf("host %s holds snapshots %v, want the fork's (taken on h1, pulled to h2)", h.name, d)
			}
		}
		src, err := e.c.Client.GetVM(ctx, e.source.ID)
		if err != nil {
			t.Fatal(err)
		}
		if src.ObservedState != api.StateRunning {
			t.Errorf("source is %s after the fork, want running (pause_source is off)", src.ObservedState)
		}
	})
}

func TestForkCountUpAndDownInPlaceThenDelete(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		e := startForkEnv(t, dbURL, 4096, nil)
		f, err := e.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: e.source.ID, Count: 2}, "")
		if err != nil {
			t.Fatal(err)
		}
		first := e.checkFork(t, f.ID, 2)
		up := 5
		if _, err := e.c.Client.UpdateFork(ctx, f.ID, api.ForkPatch{Count: &up}); err != nil {
			t.Fatal(err)
		}
		grown := e.checkFork(t, f.ID, 5)
		for i, ch := range first.Children {
			if grown.Children[i].ID != ch.ID {
				t.Errorf("slot %d changed from %s to %s when the count grew", i, ch.ID, grown.Children[i].ID)
			}
			if n := e.hosts[0].puts(ch.ID) + e.hosts[1].puts(ch.ID); n != 1 {
				t.Errorf("child %s was started %d times, want once", ch.Name, n)
			}
		}
		down := 1
		if _, err := e.c.Client.UpdateFork(ctx, f.ID, api.ForkPatch{Count: &down}); err != nil {
			t.Fatal(err)
		}
		shrunk := e.checkFork(t, f.ID, 1)
		if shrunk.Children[0].ID != first.Children[0].ID {
			t.Errorf("count down replaced slot 0")
		}

		if err := e.c.Client.DeleteFork(ctx, f.ID); err != nil {
			t.Fatal(err)
		}
		if err := e.c.Client.DeleteFork(ctx, f.ID); err != nil {
			t.Errorf("second delete: %v, want success (idempotent)", err)
		}
		if _, err := e.c.Client.GetFork(ctx, f.ID); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("get after delete: %v, want not found", err)
		}
		for _, h := range e.hosts {
			if d := h.snapshotDirs(t); len(d) != 0 {
				t.Errorf("host %s still holds snapshots %v after the delete", h.name, d)
			}
			if _, err := h.agent.Client.GetSnapshot(ctx, f.ID); !errors.Is(err, agentapi.ErrNotFound) {
				t.Errorf("host %s: snapshot after delete: %v, want not found", h.name, err)
			}
		}
		vms, err := e.c.Client.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(vms) != 1 || vms[0].ID != e.source.ID {
			t.Errorf("VMs after the delete: %+v, want only the source", vms)
		}
		checkLedger(t, e.c.Store)
		e.checkNoOrphans(t)
	})
}

// Failures injected after each step, then a retry of the same request
// (same Idempotency-Key): one snapshot, all children from it, no leaks.
func TestForkFailureAfterEachStepThenRetry(t *testing.T) {
	injected := errors.New("injected database failure")
	cases := []struct {
		name string
		step string
		slot int
	}{
		{"snapshot done, flag write fails", control.ForkStepSnapshotTaken, -1},
		{"flag durable, a child reservation fails", control.ForkStepChildReserve, 1},
		{"child reserved, its start fails", control.ForkStepChildReserved, 0},
		{"child started, its row write fails", control.ForkStepChildStarted, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			eachDatabase(t, func(t *testing.T, dbURL string) {
				ctx := ctxT(t)
				e := startForkEnv(t, dbURL, 3072, &control.Hooks{ForkStep: once(tc.step, tc.slot, injected)})
				in := api.ForkCreate{SourceVMID: e.source.ID, Count: 3}
				key := client.NewIdempotencyKey()
				_, err := noRetry(e.c).CreateFork(ctx, in, key)
				if err == nil {
					t.Fatal("fork with an injected failure succeeded")
				}
				id := forkErrorID(t, err)
				if id == "" {
					t.Fatalf("error %v does not name the fork", err)
				}
				mid, err := e.c.Client.GetFork(ctx, id)
				if err != nil {
					t.Fatal(err)
				}
				// One failed pass: retried in the background later (the
				// default backoff is far longer than this test).
				if mid.Phase != api.ForkRetrying || mid.Attempts != 1 || mid.RetryAt == nil || mid.Error == "" {
					t.Errorf("after the failure: phase %s, attempts %d, retry_at %v, error %q; want retrying after 1 attempt, a retry time and the reason",
						mid.Phase, mid.Attempts, mid.RetryAt, mid.Error)
				}
				if !mid.SnapshotTaken && len(mid.Children) > 0 {
					t.Errorf("children %v exist while snapshot_taken is false", mid.Children)
				}
				checkLedger(t, e.c.Store)
				e.checkNoOrphans(t)

				f, err := noRetry(e.c).CreateFork(ctx, in, key)
				if err != nil {
					t.Fatalf("retry: %v", err)
				}
				if f.ID != id {
					t.Errorf("retry made fork %s, want the first one %s resumed", f.ID, id)
				}
				final := e.checkFork(t, id, 3)
				for _, before := range mid.Children {
					if before.ObservedState != api.StateRunning {
						continue
					}
					if final.Children[slotIndex(t, id, before.Name)].ID != before.ID {
						t.Errorf("running child %s was replaced by the retry", before.Name)
					}
					if n := e.hosts[0].puts(before.ID) + e.hosts[1].puts(before.ID); n != 1 {
						t.Errorf("running child %s was started %d times, want once", before.Name, n)
					}
				}
			})
		})
	}
}

func slotIndex(t *testing.T, forkID, name string) int {
	t.Helper()
	var i int
	if _, err := fmt.Sscanf(strings.TrimPrefix(name, forkID+"-"), "%d", &i); err != nil {
		t.Fatalf("child name %s: %v", name, err)
	}
	return i
}

// A process "crash" between any two steps (the pass stops dead: no cleanup,
// no further write), then a new control API on the same database, which
// resumes the fork at start-up, or a retried request.
func TestForkCrashBetweenStepsThenRestart(t *testing.T) {
	steps := []struct {
		step string
		slot int
	}{
		{control.ForkStepSnapshotStart, -1},
		{control.ForkStepSnapshotTaken, -1},
		{control.ForkStepFlagWritten, -1},
		{control.ForkStepChildReserve, 1},
		{control.ForkStepChildReserved, 2},
		{control.ForkStepChildStart, 1},
		{control.ForkStepChildStarted, 0},
		{control.ForkStepChildRecorded, 1},
	}
	for _, sc := range steps {
		for _, retry := range []string{"restart", "request"} {
			t.Run(fmt.Sprintf("%s/%d/%s", sc.step, sc.slot, retry), func(t *testing.T) {
				eachDatabase(t, func(t *testing.T, dbURL string) {
					ctx := ctxT(t)
					crash := &control.Hooks{ForkStep: once(sc.step, sc.slot, control.ErrSimulatedCrash)}
					e := startForkEnv(t, dbURL, 3072, crash)
					in := api.ForkCreate{SourceVMID: e.source.ID, Count: 3}
					key := client.NewIdempotencyKey()
					_, err := noRetry(e.c).CreateFork(ctx, in, key)
					if err == nil {
						t.Fatal("fork with a simulated crash succeeded")
					}
					forks, err := e.c.Store.UnfinishedForks(ctx, time.Now().Add(time.Minute))
					if err != nil || len(forks) != 1 {
						t.Fatalf("unfinished forks after the crash: %v, %v; want one", forks, err)
					}
					id := forks[0].ID
					children, err := e.c.Store.ListVMs(ctx, store.VMFilter{ForkID: id})
					if err != nil {
						t.Fatal(err)
					}
					if !forks[0].SnapshotTaken && len(children) > 0 {
						t.Errorf("children exist before snapshot_taken is durable: %+v", children)
					}
					if retry == "restart" {
						e.restart(t, nil)
						eventually(t, "the restarted control API resumes the fork", func() bool {
							f, err := e.c.Client.GetFork(ctx, id)
							return err == nil && f.Phase == api.ForkReady
						})
					} else {
						e.restart(t, nil)
						f, err := noRetry(e.c).CreateFork(ctx, in, key)
						// The restart's own resume may hold the fork: then
						// this request waits for it and returns the result.
						if err != nil {
							t.Fatalf("retry after the crash: %v", err)
						}
						if f.ID != id {
							t.Errorf("retry made fork %s, want %s resumed", f.ID, id)
						}
					}
					e.checkFork(t, id, 3)
				})
			})
		}
	}
}

func TestForkValidation(t *testing.T) {
	ctx := ctxT(t)
	e := startForkEnv(t, "", 8192, nil)
	stopped := smallVM("stopped")
	stopped.PowerState = api.PowerStopped
	sv, err := e.c.Client.CreateVM(ctx, stopped, "")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		in   api.ForkCreate
		code string
	}{
		{"count zero", api.ForkCreate{SourceVMID: e.source.ID, Count: 0}, api.CodeInvalid},
		{"count over the limit", api.ForkCreate{SourceVMID: e.source.ID, Count: control.MaxForkChildren + 1}, api.CodeInvalid},
		{"bad placement", api.ForkCreate{SourceVMID: e.source.ID, Count: 1, Placement: "pack"}, api.CodeInvalid},
		{"no source", api.ForkCreate{Count: 1}, api.CodeInvalid},
		{"unknown source", api.ForkCreate{SourceVMID: "nope", Count: 1}, api.CodeInvalid},
		{"stopped source", api.ForkCreate{SourceVMID: sv.ID, Count: 1}, api.CodeConflict},
	}
	for _, tc := range cases {
		_, err := noRetry(e.c).CreateFork(ctx, tc.in, "")
		if got := apiCode(err); got != tc.code {
			t.Errorf("%s: error %v (code %q), want %s", tc.name, err, got, tc.code)
		}
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.c.URL+"/v1/forks",
		bytes.NewReader([]byte(`{"source_vm_id":"`+e.source.ID+`","count":1,"colour":"red"}`)))
	req.Header.Set("Authorization", "Bearer "+e.c.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("unknown field: status %d, want 400", resp.StatusCode)
	}
	zero := 0
	f, err := e.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: e.source.ID, Count: 1}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := noRetry(e.c).UpdateFork(ctx, f.ID, api.ForkPatch{Count: &zero}); apiCode(err) != api.CodeInvalid {
		t.Errorf("PATCH count 0: %v, want invalid", err)
	}
	if _, err := noRetry(e.c).GetFork(ctx, "nope"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("GET unknown fork: %v, want not found", err)
	}
	if n := e.snapshotsCreated(); n != 1 {
		t.Errorf("%d snapshots created, want 1 (invalid requests take none)", n)
	}
}
