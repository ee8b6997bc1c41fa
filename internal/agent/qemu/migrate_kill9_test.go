package qemu_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var kvmdBin struct {
	once sync.Once
	path string
	err  error
}

func buildAgentBinary(t *testing.T) string {
	t.Helper()
	kvmdBin.once.Do(func() {
		dir, err := os.MkdirTemp("", "kvmd-migtest-bin-")
		if err != nil {
			kvmdBin.err = err
			return
		}
		kvmdBin.path = filepath.Join(dir, "kvmd")
		if out, err := exec.Command("go", "build", "-o", kvmdBin.path, "github.com/kvmfleet/terraform-provider-kvm/server").CombinedOutput(); err != nil {
			kvmdBin.err = fmt.Errorf("go build kvmd: %v: %s", err, out)
		}
	})
	if kvmdBin.err != nil {
		t.Fatal(kvmdBin.err)
	}
	return kvmdBin.path
}

// procAgent is a kvmd agent process, killed with SIGKILL and started
// again on the same state directory and address.
type procAgent struct {
	t         *testing.T
	bin, dir  string
	listen    string
	advertise string
	cmd       *exec.Cmd
	client    *agentapi.Client
	key       string
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String()
}

func startProcAgent(t *testing.T, advertise string) *procAgent {
	p := &procAgent{t: t, bin: buildAgentBinary(t), dir: t.TempDir(), listen: freePort(t), advertise: advertise}
	p.start()
	t.Cleanup(func() {
		p.kill()
		for _, pid := range qemu.ProcessesUnder(p.dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return p
}

func (p *procAgent) start() {
	t := p.t
	args := []string{"agent", "--listen", p.listen, "--state-dir", p.dir, "--image-dir", testenv.GuestImageDir(t),
		"--accel", testenv.Accel(), "--token", "agent-token", "--log-level", "warn"}
	if p.advertise != "" {
		args = append(args, "--advertise-url", p.advertise)
	}
	p.cmd = exec.Command(p.bin, args...)
	p.cmd.Stderr = os.Stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.client = agentapi.NewClient("http://"+p.listen, "agent-token", agentapi.WithRetries(0))
	deadline := time.Now().Add(time.Minute)
	for {
		if _, err := p.client.Info(context.Background()); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent on %s did not answer within a minute", p.listen)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if p.key == "" {
		p.key = p.identityKey()
	}
}

// identityKey asks the agent to prove itself and returns the key.
func (p *procAgent) identityKey() string {
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce([]byte("0123456789abcdef0123456789abcdef")), Address: "http://" + p.listen}
	proof, err := p.client.Identity(context.Background(), ch)
	if err != nil {
		p.t.Fatal(err)
	}
	return proof.PublicKey
}

func (p *procAgent) kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	}
}

func (p *procAgent) restart() {
	p.kill()
	p.start()
}

func (p *procAgent) ref() agentapi.PeerRef {
	addr := "http://" + p.listen
	if p.advertise != "" {
		addr = p.advertise
	}
	return agentapi.PeerRef{Address: addr, PublicKey: p.key}
}

func (p *procAgent) console(id string) string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "vms", id, "console.log"))
	return string(b)
}

func (p *procAgent) waitCount(t *testing.T, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		if cs := counts(p.console(id)); len(cs) > 0 && cs[len(cs)-1] >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: no kvm-count %d within %s", id, n, bootWait)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (p *procAgent) waitState(t *testing.T, id, state string) agentapi.VM {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		vm, err := p.client.GetVM(context.Background(), id)
		if err == nil && vm.State == state {
			return vm
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: state %q (%v), want %s", id, vm.State, err, state)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (p *procAgent) running(id string) []int {
	return qemu.ProcessesOf(filepath.Join(p.dir, "vms", id))
}

// TestKill9SourceDuringPreCopy: the source agent dies mid pre-copy; the
// VM keeps running on the source (QEMU fails the stream it can no longer
// write), the restarted source says so, the target's copy fails, never ran.
func TestKill9SourceDuringPreCopy(t *testing.T) {
	ctx := context.Background()
	src, dst := startProcAgent(t, ""), startProcAgent(t, "")
	const id = "k9pre"
	spec := migGuest(id, dirtyScript, 256)
	if _, err := src.client.CreateVM(ctx, id, spec); err != nil {
		t.Fatal(err)
	}
	src.waitCount(t, id, 20)
	if _, err := dst.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: dst.ref(), Live: true, MaxDowntimeMS: 1}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(bootWait)
	for {
		mig, err := src.client.Migration(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if mig.State != agentapi.MigrationRunning {
			t.Fatalf("migration ended before the kill: %+v", mig)
		}
		if mig.Phase == agentapi.PhaseMemory && mig.Memory.Transferred > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no pre-copy")
		}
		time.Sleep(50 * time.Millisecond)
	}
	src.kill()
	src.start()
	vm := src.waitState(t, id, agentapi.StateRunning)
	var mig agentapi.Migration
	for range 100 { // QEMU fails the stream once it writes to the dead agent's end
		var err error
		if mig, err = src.client.Migration(ctx, id); err != nil {
			t.Fatal(err)
		}
		if mig.State != agentapi.MigrationRunning {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if mig.State != agentapi.MigrationFailed {
		t.Fatalf("migration after the source's restart: %+v; want failed", mig)
	}
	cs := counts(src.console(id))
	src.waitCount(t, id, cs[len(cs)-1]+10)
	dst.waitState(t, id, agentapi.StateFailed)
	if p := dst.running(id); len(p) != 0 {
		t.Fatalf("target still has qemu %v", p)
	}
	t.Logf("source vm %s running (pid %d) after the kill; migration %s: %s", id, vm.PID, mig.State, mig.Error)
}

// TestKill9AfterStreamBeforeCommit: the stream completed, the target was
// not committed yet (a proxy holds its commit back), and the source agent
// dies: the restarted source reports the VM migrated and never runs it;
// once the target answers, the source commits it and the target runs the
// VM; then the target agent dies and its restart still runs it: one copy.
func TestKill9AfterStreamBeforeCommit(t *testing.T) {
	ctx := context.Background()
	// The target behind a proxy that can hold commits back.
	proxyAddr := freePort(t)
	src, dst := startProcAgent(t, ""), startProcAgent(t, "http://"+proxyAddr)
	var block atomic.Bool
	block.Store(true)
	target, _ := url.Parse("http://" + dst.listen)
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := &http.Server{Addr: proxyAddr, ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if block.Load() && strings.HasSuffix(r.URL.Path, "/incoming/commit") {
			http.Error(w, `{"error":{"code":"unavailable","message":"test: commit held back"}}`, http.StatusServiceUnavailable)
			return
		}
		rp.ServeHTTP(w, r)
	})}
	l, err := net.Listen("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })

	const id = "k9sw"
	spec := migGuest(id, counterScript, 128)
	if _, err := src.client.CreateVM(ctx, id, spec); err != nil {
		t.Fatal(err)
	}
	src.waitCount(t, id, 20)
	if _, err := dst.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	// Kill -9 of the target once prepared: its restart changes nothing.
	dst.restart()
	dst.waitState(t, id, agentapi.StateIncoming)
	if _, err := src.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	src.waitState(t, id, agentapi.StateMigrated)
	if vm := dst.waitState(t, id, agentapi.StateIncoming); vm.State != agentapi.StateIncoming {
		t.Fatal("target not incoming")
	}
	before := counts(src.console(id))
	src.kill()
	src.start()
	if vm := src.waitState(t, id, agentapi.StateMigrated); vm.State != agentapi.StateMigrated {
		t.Fatal("source not migrated after restart")
	}
	// Neither runs the guest meanwhile: the counter stands still.
	time.Sleep(time.Second)
	if after := counts(src.console(id)); len(after) != len(before) || len(counts(dst.console(id))) != 0 {
		t.Fatalf("the guest ran while the commit was held back: source %d->%d lines, target %d", len(before), len(after), len(counts(dst.console(id))))
	}
	block.Store(false)
	dst.waitState(t, id, agentapi.StateRunning)
	dst.waitCount(t, id, before[len(before)-1]+10)
	deadline := time.Now().Add(time.Minute)
	for {
		mig, err := src.client.Migration(ctx, id)
		if err == nil && mig.State == agentapi.MigrationCompleted {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("migration after the commit: %+v, %v; want completed", mig, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Kill -9 of the target after the switch, and of the source before its
	// copy is deleted: still one copy, running on the target.
	dst.restart()
	src.restart()
	dst.waitState(t, id, agentapi.StateRunning)
	src.waitState(t, id, agentapi.StateMigrated)
	cs := counts(dst.console(id))
	dst.waitCount(t, id, cs[len(cs)-1]+5)
	if strings.Contains(dst.console(id), "kvm-guest-ready") {
		t.Fatal("the guest rebooted on the target")
	}
	if err := src.client.DeleteVM(ctx, id); err != nil {
		t.Fatal(err)
	}
}

// TestKill9TargetDuringPreCopy: the target agent dies mid pre-copy: the
// migration fails on the source, where the VM runs on; the restarted
// target reports its copy failed (its QEMU lost its stream and exited).
func TestKill9TargetDuringPreCopy(t *testing.T) {
	ctx := context.Background()
	src, dst := startProcAgent(t, ""), startProcAgent(t, "")
	const id = "k9tgt"
	spec := migGuest(id, dirtyScript, 256)
	if _, err := src.client.CreateVM(ctx, id, spec); err != nil {
		t.Fatal(err)
	}
	src.waitCount(t, id, 20)
	if _, err := dst.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: dst.ref(), Live: true, MaxDowntimeMS: 1}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(bootWait)
	for {
		mig, err := src.client.Migration(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if mig.Phase == agentapi.PhaseMemory && mig.Memory.Transferred > 0 {
			break
		}
		if mig.State != agentapi.MigrationRunning || time.Now().After(deadline) {
			t.Fatalf("no pre-copy: %+v", mig)
		}
		time.Sleep(50 * time.Millisecond)
	}
	dst.kill()
	var mig agentapi.Migration
	for range 600 {
		var err error
		if mig, err = src.client.Migration(ctx, id); err != nil {
			t.Fatal(err)
		}
		if mig.State != agentapi.MigrationRunning {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if mig.State != agentapi.MigrationFailed {
		t.Fatalf("migration after the target's kill: %+v; want failed", mig)
	}
	src.waitState(t, id, agentapi.StateRunning)
	cs := counts(src.console(id))
	src.waitCount(t, id, cs[len(cs)-1]+10)
	dst.start()
	dst.waitState(t, id, agentapi.StateFailed)
	if p := dst.running(id); len(p) != 0 {
		t.Fatalf("target still has qemu %v", p)
	}
}
