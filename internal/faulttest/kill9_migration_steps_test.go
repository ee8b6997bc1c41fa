package faulttest

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Issue 27 item 7 under kill -9: `kvmd control`, the source `kvmd agent`
// (h1) or the target `kvmd agent` (h2), all real processes with the sim
// driver, is killed at each step of a live migration while a gate in front
// of an agent holds the migration there:
//
//   - after the target reservation: the target's PUT incoming is held
//     before the target sees it (the reservation is the only thing done);
//   - during pre-copy: the memory stream is held after its first page
//     (the sim acknowledges each page, so the source waits in phase
//     memory, the guest running);
//   - during stop-and-copy: the stream is held at its end line (the
//     source's guest paused, phase stop-and-copy, the target not complete);
//   - after the switch: the guest switched to the target (the source
//     committed it there and reports completed) and the control plane's
//     GET of that answer is held, so the row still names the source;
//   - before the source release: the row points at the target and the
//     source's DELETE of its stopped copy is held.
//
// Before the kill the test checks through the agents' own API (past the
// gates) that the migration is at that step and no further; the gate keeps
// it there until the kill. Afterwards exactly one agent has the VM and it
// runs there, the row names that host, each host's allocation is its rows'
// (the other host's share released), no migration is left, the restarted
// source never ran a copy that had migrated away, and a further migration
// works.

// migStep is one step a migration is held at.
type migStep struct {
	// call holds the first matching call on the gate of gateHost; forward
	// says it reaches the agent first (its answer is held, the first one
	// that contains answer).
	gateHost string
	call     func(*http.Request) bool
	forward  bool
	answer   string
	// streamLine holds the memory stream (on the target's gate) at the
	// first line it matches.
	streamLine func(string) bool
	// at checks, before the kill, that the migration is at this step.
	at func(ctx context.Context, r *migRig, id string) error
	// wantHost is where the VM runs afterwards, by the process killed.
	wantHost map[string]string
	// pollsWhileDown: the control plane's request keeps asking the killed
	// source until it is back, so the test restarts it without waiting for
	// the request's answer.
	pollsWhileDown bool
}

func migSteps() map[string]migStep {
	incoming := func(ctx context.Context, r *migRig, id string) error {
		vm, err := r.agents["h2"].client.GetVM(ctx, id)
		if err != nil || vm.State != agentapi.StateIncoming {
			return fmt.Errorf("the target has vm %s as %q (%v); want incoming", id, vm.State, err)
		}
		return nil
	}
	sourcePhase := func(ctx context.Context, r *migRig, id, phase string) error {
		m, err := r.agents["h1"].client.Migration(ctx, id)
		if err != nil || m.State != agentapi.MigrationRunning || m.Phase != phase {
			return fmt.Errorf("the source's migration of vm %s is %q in phase %q (%v); want running in %s", id, m.State, m.Phase, err, phase)
		}
		return incoming(ctx, r, id)
	}
	row := func(ctx context.Context, r *migRig, id, host, state string) error {
		vm, err := r.k.client(true).GetVM(ctx, id)
		if err != nil {
			return err
		}
		if vm.Host != host || vm.Migration == nil || vm.Migration.State != state {
			return fmt.Errorf("vm %s row on %s with migration %+v; want on %s, migration %s", id, vm.Host, vm.Migration, host, state)
		}
		return nil
	}
	switched := func(ctx context.Context, r *migRig, id string) error {
		src, err := r.agents["h1"].client.GetVM(ctx, id)
		if err != nil || src.State != agentapi.StateMigrated {
			return fmt.Errorf("the source has vm %s as %q (%v); want migrated", id, src.State, err)
		}
		m, err := r.agents["h1"].client.Migration(ctx, id)
		if err != nil || m.State != agentapi.MigrationCompleted {
			return fmt.Errorf("the source's migration of vm %s is %q (%v); want completed", id, m.State, err)
		}
		dst, err := r.agents["h2"].client.GetVM(ctx, id)
		if err != nil || dst.State != agentapi.StateRunning {
			return fmt.Errorf("the target has vm %s as %q (%v); want running", id, dst.State, err)
		}
		return nil
	}
	return map[string]migStep{
		"after the target reservation": {
			gateHost: "h2", call: isCall(http.MethodPut, "/v1/vms/", "/incoming"),
			at: func(ctx context.Context, r *migRig, id string) error {
				if _, err := r.agents["h2"].client.GetVM(ctx, id); !errors.Is(err, agentapi.ErrNotFound) {
					return fmt.Errorf("the target has vm %s already (%v)", id, err)
				}
				if _, err := r.agents["h1"].client.Migration(ctx, id); !errors.Is(err, agentapi.ErrNotFound) {
					return fmt.Errorf("the source was asked to migrate vm %s already (%v)", id, err)
				}
				return row(ctx, r, id, "h1", "reserved")
			},
			wantHost: map[string]string{"control": "h1", "source": "h1", "target": "h1"},
		},
		"during pre-copy": {
			streamLine: func(l string) bool { return strings.HasPrefix(l, "sim-page 2/") },
			at: func(ctx context.Context, r *migRig, id string) error {
				return sourcePhase(ctx, r, id, agentapi.PhaseMemory)
			},
			wantHost:       map[string]string{"control": "h2", "source": "h1", "target": "h1"},
			pollsWhileDown: true,
		},
		"during stop-and-copy": {
			streamLine: func(l string) bool { return l == "sim-end\n" },
			at: func(ctx context.Context, r *migRig, id string) error {
				return sourcePhase(ctx, r, id, agentapi.PhaseStopAndCopy)
			},
			wantHost:       map[string]string{"control": "h2", "source": "h1", "target": "h1"},
			pollsWhileDown: true,
		},
		"after the switch": {
			gateHost: "h1", call: isCall(http.MethodGet, "/v1/vms/", "/migration"), forward: true,
			answer: `"state":"completed"`,
			at: func(ctx context.Context, r *migRig, id string) error {
				if err := switched(ctx, r, id); err != nil {
					return err
				}
				return row(ctx, r, id, "h1", "moving")
			},
			wantHost:       map[string]string{"control": "h2", "source": "h2", "target": "h2"},
			pollsWhileDown: true,
		},
		"before the source release": {
			gateHost: "h1", call: isCall(http.MethodDelete, "/v1/vms/", ""),
			at: func(ctx context.Context, r *migRig, id string) error {
				if err := switched(ctx, r, id); err != nil {
					return err
				}
				return row(ctx, r, id, "h2", "switched")
			},
			wantHost: map[string]string{"control": "h2", "source": "h2", "target": "h2"},
		},
	}
}

func TestKill9MigrationAfterReservation(t *testing.T) {
	kill9MigrationStep(t, "after the target reservation")
}

func TestKill9MigrationDuringPreCopy(t *testing.T) { kill9MigrationStep(t, "during pre-copy") }

func TestKill9MigrationDuringStopAndCopy(t *testing.T) {
	kill9MigrationStep(t, "during stop-and-copy")
}

func TestKill9MigrationAfterSwitch(t *testing.T) { kill9MigrationStep(t, "after the switch") }

func TestKill9MigrationBeforeSourceRelease(t *testing.T) {
	kill9MigrationStep(t, "before the source release")
}

// kill9MigrationStep kills each process in turn at step name: control on
// SQLite and PostgreSQL, each agent with SQLite.
func kill9MigrationStep(t *testing.T, name string) {
	bin := buildKVMD(t)
	step := migSteps()[name]
	t.Run("control/sqlite", func(t *testing.T) { kill9AtMigStep(t, bin, "", t.TempDir(), step, "control") })
	t.Run("control/postgres", func(t *testing.T) { kill9AtMigStep(t, bin, testenv.PostgresURL(t), "", step, "control") })
	t.Run("source agent", func(t *testing.T) { kill9AtMigStep(t, bin, "", t.TempDir(), step, "source") })
	t.Run("target agent", func(t *testing.T) { kill9AtMigStep(t, bin, "", t.TempDir(), step, "target") })
}

// migRig is kvmd control and two kvmd agents (h1 the source, h2 the
// target), each agent behind its gate, registered by the gate's address.
type migRig struct {
	k      *kvmdControl
	agents map[string]*kvmdAgent
	gates  map[string]*migGate
}

func startMigRig(t *testing.T, bin, databaseURL, dataDir string) *migRig {
	t.Helper()
	r := &migRig{agents: map[string]*kvmdAgent{}, gates: map[string]*migGate{}}
	r.k = startKVMD(t, bin, databaseURL, dataDir)
	for _, h := range []string{"h1", "h2"} {
		addr := freeAddress(t)
		r.gates[h] = startMigGate(t, addr)
		r.agents[h] = startKVMDAgentAt(t, bin, addr, r.gates[h].url)
		if _, err := r.k.client(true).PutHost(context.Background(), h, api.HostPut{Address: r.gates[h].url}); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// watchOneRunningCopy watches, until the returned function is called,
// that the two agents never both run VM id (the target is read first: a
// migration makes the source stop before the target runs, so a read of
// the source after the target's never sees an older running copy). The
// function returns the first time both ran it.
func (r *migRig) watchOneRunningCopy(ctx context.Context, id string) func() error {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	running := func(h string) bool {
		vm, err := r.agents[h].client.GetVM(ctx, id)
		return err == nil && vm.State == agentapi.StateRunning
	}
	go func() {
		for ctx.Err() == nil {
			if running("h2") && running("h1") {
				done <- fmt.Errorf("both agents ran vm %s at once", id)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		done <- nil
	}()
	return func() error {
		cancel()
		return <-done
	}
}

func (r *migRig) listers() map[string]agentLister {
	out := map[string]agentLister{}
	for h, a := range r.agents {
		c := a.client
		out[h] = func(ctx context.Context) ([]string, error) {
			vms, err := c.ListVMs(ctx)
			ids := make([]string, 0, len(vms))
			for _, v := range vms {
				ids = append(ids, v.ID)
			}
			return ids, err
		}
	}
	return out
}

// settled is the end state: the ledger agrees (each agent has exactly the
// VMs whose rows hold capacity on its host), no migration is left, and
// the VM runs on host, its row naming it.
func (r *migRig) settled(ctx context.Context, id, host string) error {
	c := r.k.client(true)
	if err := ledger(ctx, c, r.listers()); err != nil {
		return err
	}
	row, err := c.GetVM(ctx, id)
	if err != nil {
		return err
	}
	if row.Migration != nil {
		return fmt.Errorf("vm %s still migrating: %+v", id, *row.Migration)
	}
	if row.Host != host || row.ObservedState != api.StateRunning {
		return fmt.Errorf("vm %s row: %s on %s; want running on %s", id, row.ObservedState, row.Host, host)
	}
	vm, err := r.agents[host].client.GetVM(ctx, id)
	if err != nil || vm.State != agentapi.StateRunning {
		return fmt.Errorf("the agent of %s has vm %s as %q (%v); want running", host, id, vm.State, err)
	}
	return nil
}

func kill9AtMigStep(t *testing.T, bin, databaseURL, dataDir string, step migStep, victim string) {
	ctx := ctxT(t, 3*time.Minute)
	r := startMigRig(t, bin, databaseURL, dataDir)
	var vm api.VM
	eventually(t, "the hosts are synced and take a VM", func() error {
		var err error
		vm, err = r.k.client(false).CreateVM(ctx, api.VMCreate{Name: "db", Image: "sim", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 1024, Host: "h1"}, "")
		return err
	})
	gate := r.gates["h2"]
	if step.streamLine != nil {
		gate.holdStream(vm.ID, step.streamLine)
	} else {
		gate = r.gates[step.gateHost]
		gate.holdCall(step.call, step.forward, step.answer)
	}
	answered := make(chan error, 1)
	go func() {
		_, err := r.k.client(false).MigrateVM(ctx, vm.ID, "h2")
		answered <- err
	}()
	select {
	case <-gate.reached:
	case err := <-answered:
		t.Fatalf("the migration answered (%v) before the gate held it", err)
	case <-ctx.Done():
		t.Fatal("the migration never reached the gate")
	}
	if err := step.at(ctx, r, vm.ID); err != nil {
		t.Fatalf("held, but not at the step: %v", err)
	}

	wantHost := step.wantHost[victim]
	twice := r.watchOneRunningCopy(ctx, vm.ID)
	switch victim {
	case "control":
		r.k.kill()
		if err := <-answered; err == nil {
			t.Fatal("the migration answered success although kvmd control was killed before it finished")
		}
		gate.release() // the agents go on without the control plane
		r.k = startKVMD(t, bin, databaseURL, dataDir)
	default:
		host := map[string]string{"source": "h1", "target": "h2"}[victim]
		a := r.agents[host]
		a.kill()
		if step.streamLine != nil || step.gateHost == host {
			gate.cut() // the held call or stream was the killed agent's, or its peer's stream to it
		} else {
			gate.release() // the other agent's call goes on
		}
		if !step.pollsWhileDown || victim == "target" {
			// The request ends without the killed agent.
			err := <-answered
			t.Logf("the migration answered while the %s agent was down: %v", victim, err)
			if err == nil && wantHost == "h1" {
				t.Fatal("the migration answered success although its VM stayed on the source")
			}
		}
		a.start(t)
		if victim == "source" && wantHost == "h2" {
			// The copy that migrated away is never run again here.
			got, err := a.client.GetVM(ctx, vm.ID)
			if err == nil && got.State != agentapi.StateMigrated {
				t.Fatalf("the restarted source has vm %s as %s; a copy that migrated away must stay migrated until deleted", vm.ID, got.State)
			}
		}
		if step.pollsWhileDown && victim == "source" {
			t.Logf("the migration answered once the source was back: %v", <-answered)
		}
	}
	eventually(t, "the migration is settled on one host", func() error { return r.settled(ctx, vm.ID, wantHost) })
	if err := twice(); err != nil {
		t.Fatal(err)
	}

	// A further migration works, once the restarted agent's host is
	// alive again for the control plane (a loaded machine delays that).
	other := map[string]string{"h1": "h2", "h2": "h1"}[wantHost]
	eventually(t, "a further migration to "+other, func() error {
		_, err := r.k.client(true).MigrateVM(ctx, vm.ID, other)
		return err
	})
	if err := r.settled(ctx, vm.ID, other); err != nil {
		t.Error(err)
	}
}

// migGate sits between the other processes and one kvmd agent. Armed, it
// holds one thing and closes reached: the first matching plain call (before
// the agent sees it, or after the agent answered, the answer kept back), or
// the memory stream of a migration at a line (nothing from that line on
// reaches the agent; the agent's own answers still flow back). release lets
// the held thing go on, cut drops its connections. Every other call and
// stream passes.
type migGate struct {
	url, agent string
	proxy      *httputil.ReverseProxy
	reached    chan struct{}
	released   chan struct{}
	cutoff     chan struct{}
	stop       chan struct{}

	mu         sync.Mutex
	call       func(*http.Request) bool
	forward    bool
	answer     string
	streamVM   string
	streamLine func(string) bool
	held       bool
	endOnce    sync.Once
}

func startMigGate(t *testing.T, agentAddr string) *migGate {
	t.Helper()
	target, err := url.Parse("http://" + agentAddr)
	if err != nil {
		t.Fatal(err)
	}
	g := &migGate{agent: agentAddr, proxy: httputil.NewSingleHostReverseProxy(target), reached: make(chan struct{}),
		released: make(chan struct{}), cutoff: make(chan struct{}), stop: make(chan struct{})}
	g.proxy.ErrorLog = log.New(io.Discard, "", 0) // a killed agent is refused on purpose
	srv := httptest.NewServer(http.HandlerFunc(g.serve))
	t.Cleanup(func() { close(g.stop); srv.Close() })
	g.url = srv.URL
	return g
}

func (g *migGate) holdCall(match func(*http.Request) bool, forward bool, answer string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.call, g.forward, g.answer = match, forward, answer
}

func (g *migGate) holdStream(vm string, line func(string) bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.streamVM, g.streamLine = vm, line
}

func (g *migGate) release() { g.endOnce.Do(func() { close(g.released) }) }
func (g *migGate) cut()     { g.endOnce.Do(func() { close(g.cutoff) }) }

// matches reports whether r is a call to hold, while none is held.
func (g *migGate) matches(r *http.Request) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return !g.held && g.call != nil && g.call(r)
}

// take reports whether the call (whose answer is given when forwarded)
// is the one to hold: the first that matches.
func (g *migGate) take(answer []byte) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held || (g.answer != "" && !bytes.Contains(answer, []byte(g.answer))) {
		return false
	}
	g.held = true
	return true
}

// takeStream reports whether r opens the memory stream to hold, and at
// which line.
func (g *migGate) takeStream(r *http.Request) func(string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held || g.streamLine == nil || r.URL.Path != "/v1/vms/"+g.streamVM+"/incoming/stream" ||
		r.URL.Query().Get("channel") != agentapi.ChannelMemory {
		return nil
	}
	g.held = true
	return g.streamLine
}

// wait blocks until the held thing is released (true) or cut, or its
// caller went away (false).
func (g *migGate) wait(caller context.Context) bool {
	select {
	case <-g.released:
		return true
	case <-g.cutoff:
	case <-caller.Done():
	case <-g.stop:
	}
	return false
}

func (g *migGate) serve(w http.ResponseWriter, r *http.Request) {
	if line := g.takeStream(r); line != nil {
		g.relayStream(w, r, line)
		return
	}
	if !g.matches(r) {
		g.proxy.ServeHTTP(w, r)
		return
	}
	if g.forward {
		rec := httptest.NewRecorder()
		g.proxy.ServeHTTP(rec, r.WithContext(context.WithoutCancel(r.Context())))
		if g.take(rec.Body.Bytes()) {
			close(g.reached)
			if !g.wait(r.Context()) {
				panic(http.ErrAbortHandler) // the connection drops without an answer
			}
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		return
	}
	body, _ := io.ReadAll(r.Body)
	if !g.take(nil) {
		r.Body = io.NopCloser(bytes.NewReader(body))
		g.proxy.ServeHTTP(w, r)
		return
	}
	close(g.reached)
	if !g.wait(r.Context()) {
		panic(http.ErrAbortHandler)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	g.proxy.ServeHTTP(w, r)
}

// relayStream relays one migration channel between the source agent and
// this gate's agent: the upgrade, the challenge and its signed answer
// pass; then the source's lines pass up to the first one hold matches,
// which waits (and everything after it) until release. The agent's side
// (its challenge, the page acknowledgements, the final answer) always
// flows back. Either side closing closes both.
func (g *migGate) relayStream(w http.ResponseWriter, r *http.Request, hold func(string) bool) {
	up, err := net.Dial("tcp", g.agent)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	down, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		_ = up.Close()
		return
	}
	closeBoth := func() { _ = up.Close(); _ = down.Close() }
	defer closeBoth()
	back := make(chan struct{})
	go func() {
		defer close(back)
		_, _ = io.Copy(down, up)
		closeBoth()
	}()
	if err := r.Write(up); err != nil {
		return
	}
	src := brw.Reader
	sig := make([]byte, ed25519.SignatureSize)
	if _, err := io.ReadFull(src, sig); err != nil {
		return
	}
	if _, err := up.Write(sig); err != nil {
		return
	}
	held := false
	for {
		line, err := src.ReadString('\n')
		if line != "" && !held && hold(line) {
			held = true
			close(g.reached)
			if !g.wait(context.Background()) {
				return
			}
		}
		if line != "" {
			if _, werr := up.Write([]byte(line)); werr != nil {
				return
			}
		}
		if err != nil {
			// The source is done sending: the agent's answer still comes back.
			if cw, ok := up.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			}
			<-back
			return
		}
	}
}
