package faulttest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var kvmdBuild struct {
	once sync.Once
	path string
	err  error
}

// buildKVMD builds the real kvmd binary once per test binary.
func buildKVMD(t *testing.T) string {
	t.Helper()
	kvmdBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "kvmd-faulttest-bin-")
		if err != nil {
			kvmdBuild.err = err
			return
		}
		kvmdBuild.path = filepath.Join(dir, "kvmd")
		out, err := exec.Command("go", "build", "-o", kvmdBuild.path, "github.com/kvmfleet/terraform-provider-kvm/server").CombinedOutput()
		if err != nil {
			kvmdBuild.err = fmt.Errorf("go build kvmd: %v: %s", err, out)
		}
	})
	if kvmdBuild.err != nil {
		t.Fatal(kvmdBuild.err)
	}
	return kvmdBuild.path
}

func TestMain(m *testing.M) {
	code := m.Run()
	for _, bin := range []string{kvmdBuild.path, faultgateBuild.path} {
		if bin != "" {
			_ = os.RemoveAll(filepath.Dir(bin))
		}
	}
	os.Exit(code)
}

// kvmdControl is `kvmd control` running as a child process.
type kvmdControl struct {
	url  string
	cmd  *exec.Cmd
	done chan struct{}
}

// LogDirEnv, when set, is a directory where each kvmd control of these
// tests writes its log (kvmd-control-*.log), kept after the test.
const LogDirEnv = "KVM_FAULTTEST_LOG_DIR"

// shortened are the flags of startKVMD: a short host monitor interval and
// grace periods.
var shortened = []string{"--sync-interval", "200ms", "--create-grace", "1s", "--orphan-grace", "1s"}

// startKVMD starts `kvmd control` on a free port with a short host monitor
// interval and grace periods, and waits until /readyz answers 200.
func startKVMD(t *testing.T, bin, databaseURL, dataDir string) *kvmdControl {
	t.Helper()
	return startKVMDFlags(t, bin, databaseURL, dataDir, shortened)
}

// startKVMDFlags is startKVMD with the given tuning flags (nil: kvmd's
// defaults, as an operator runs it).
func startKVMDFlags(t *testing.T, bin, databaseURL, dataDir string, flags []string) *kvmdControl {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	args := []string{"control", "--listen", addr, "--token", "control-token", "--agent-token", "agent-token", "--log-level", "warn"}
	args = append(args, flags...)
	if databaseURL != "" {
		args = append(args, "--database-url", databaseURL)
	} else {
		args = append(args, "--data-dir", dataDir)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")} // no KVMD_* from the caller's environment
	logDir := t.TempDir()
	if d := os.Getenv(LogDirEnv); d != "" {
		logDir = d
	}
	log, err := os.CreateTemp(logDir, "kvmd-control-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start kvmd control: %v", err)
	}
	k := &kvmdControl{url: "http://" + addr, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(k.done) }()
	t.Cleanup(func() { k.kill(); _ = log.Close() })
	eventually(t, "kvmd control answers /readyz", func() error {
		select {
		case <-k.done:
			out, _ := os.ReadFile(log.Name())
			t.Fatalf("kvmd control exited: %s", out)
		default:
		}
		return ready(context.Background(), k.url)
	})
	return k
}

// kill sends SIGKILL and waits for the process to be gone.
func (k *kvmdControl) kill() {
	_ = k.cmd.Process.Signal(syscall.SIGKILL)
	<-k.done
}

func (k *kvmdControl) client(retries bool) *client.Client {
	if retries {
		return client.New(k.url, "control-token")
	}
	return client.New(k.url, "control-token", client.WithRetries(0, 0))
}

// kvmd control is killed with SIGKILL while 200 creates are in flight,
// then restarted on the same database. After the host monitor's syncs no
// capacity is leaked, no row is left creating, every row that holds
// capacity has its VM on the agent and every agent VM has its row, and
// creates work again.
func TestKill9DuringCreates(t *testing.T) {
	bin := buildKVMD(t)
	t.Run("sqlite", func(t *testing.T) { kill9DuringCreates(t, bin, "", t.TempDir()) })
	t.Run("postgres", func(t *testing.T) { kill9DuringCreates(t, bin, testenv.PostgresURL(t), "") })
}

func kill9DuringCreates(t *testing.T, bin, databaseURL, dataDir string) {
	const (
		hosts   = 4
		creates = 200
		killAt  = 40 // successes seen before the kill
	)
	ctx := ctxT(t, 3*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	agents := map[string]agentLister{}
	for i := range hosts {
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		name := fmt.Sprintf("host-%d", i)
		if _, err := k.client(true).PutHost(ctx, name, api.HostPut{Address: a.Address}); err != nil {
			t.Fatal(err)
		}
		agents[name] = realAgent(a)
	}
	eventually(t, "the monitor has seen every host", func() error {
		hs, err := k.client(true).AllHosts(ctx)
		if err != nil {
			return err
		}
		for _, h := range hs {
			if !h.Alive || h.Capacity.VCPUs == 0 {
				return fmt.Errorf("host %s not synced yet", h.Name)
			}
		}
		return nil
	})

	c := k.client(false)
	var ok, failed atomic.Int64
	killed := make(chan struct{})
	var killOnce sync.Once
	var wg sync.WaitGroup
	for i := range creates {
		wg.Go(func() {
			_, err := c.CreateVM(ctx, smallVM(fmt.Sprintf("vm-%03d", i)), "")
			if err != nil {
				failed.Add(1)
				return
			}
			if ok.Add(1) == killAt {
				killOnce.Do(func() { k.kill(); close(killed) })
			}
		})
	}
	wg.Wait()
	killOnce.Do(func() { k.kill(); close(killed) })
	<-killed
	t.Logf("before the kill: %d creates answered 201; %d failed or were cut off", ok.Load(), failed.Load())
	if failed.Load() == 0 {
		t.Fatalf("every create finished before the kill; the test killed nothing in flight")
	}

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	eventually(t, "the restarted control plane reconciles rows and agents", func() error {
		return ledger(ctx, c2, agents)
	})
	vms, err := c2.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]int{}
	for _, vm := range vms {
		states[vm.ObservedState]++
	}
	t.Logf("after restart and sync: %d rows by state %v", len(vms), states)
	if int64(states[api.StateRunning]) < ok.Load() {
		t.Errorf("%d VMs running, but %d creates were answered 201 before the kill", states[api.StateRunning], ok.Load())
	}

	if states[api.StateMissing] != 0 {
		t.Errorf("%d rows missing: a create cut off before its agent made the VM should leave no row", states[api.StateMissing])
	}
	// Creates work again, and every name whose create was cut off by the
	// kill is free for the caller's retry.
	have := map[string]bool{}
	for _, vm := range vms {
		have[vm.Name] = true
	}
	retried := 0
	for i := range creates {
		name := fmt.Sprintf("vm-%03d", i)
		if have[name] {
			continue
		}
		retried++
		if _, err := c2.CreateVM(ctx, smallVM(name), ""); err != nil {
			t.Errorf("retry of %s after restart: %v", name, err)
		}
	}
	t.Logf("%d cut-off creates retried after the restart", retried)
	if err := ledger(ctx, c2, agents); err != nil {
		t.Error(err)
	}
}
