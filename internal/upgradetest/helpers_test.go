package upgradetest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// previousRelease is the release the skew contract is tested against: the
// commit before versions were announced (there are no tags yet). Move it
// to the last release tag once there is one. KVM_UPGRADE_FROM overrides it.
const previousRelease = "acff6cd309fc0874f8267760682d013c4797fb83"

// upgradeEnv gates these tests: make test-upgrade sets it.
const upgradeEnv = "KVM_UPGRADE_TEST"

// incompatibleLevel is the API level the incompatible build claims: more
// than version.MaxSkew away from this tree's.
const incompatibleLevel = "9"

const versionPkg = "github.com/kvmfleet/terraform-provider-kvm/internal/version"

// upgradeBuilds are the three kvmd binaries of the tests.
type upgradeBuilds struct {
	old, current, incompatible string
	oldCommit                  string
}

var builds struct {
	once sync.Once
	b    upgradeBuilds
	err  error
	dir  string
}

func TestMain(m *testing.M) {
	code := m.Run()
	if builds.dir != "" {
		_ = os.RemoveAll(builds.dir)
	}
	os.Exit(code)
}

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// upgradeBinaries builds (once per test binary) this tree's kvmd and its
// incompatible twin, and the previous release's kvmd: that one is cached
// in ~/.cache/kvmfleet/kvmd-<commit> (keyed by commit, outside the clone),
// built from a git worktree of the commit in a temporary directory.
func upgradeBinaries(t *testing.T) upgradeBuilds {
	t.Helper()
	if os.Getenv(upgradeEnv) == "" {
		t.Skipf("version skew test: run it with make test-upgrade (it sets %s=1)", upgradeEnv)
	}
	builds.once.Do(func() {
		builds.dir, builds.err = os.MkdirTemp("", "kvmd-upgradetest-")
		if builds.err != nil {
			return
		}
		root := repoRoot()
		b := upgradeBuilds{current: filepath.Join(builds.dir, "kvmd"), incompatible: filepath.Join(builds.dir, "kvmd-incompatible")}
		if builds.err = goBuild(root, b.current, "-X "+versionPkg+".release=0.2.0-dev"); builds.err != nil {
			return
		}
		if builds.err = goBuild(root, b.incompatible,
			"-X "+versionPkg+".release=9.0.0-incompatible -X "+versionPkg+".levelOverride="+incompatibleLevel); builds.err != nil {
			return
		}
		b.old, b.oldCommit, builds.err = previousBuild(root)
		builds.b = b
	})
	if builds.err != nil {
		t.Fatal(builds.err)
	}
	return builds.b
}

func goBuild(dir, out, ldflags string) error {
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ldflags, "-o", out, "./server")
	cmd.Dir = dir
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build kvmd in %s: %v: %s", dir, err, b)
	}
	return nil
}

// previousBuild returns the cached kvmd of the previous release, building
// it first when the cache has none. A lock file keeps two test runs from
// building it at once.
func previousBuild(root string) (bin, commit string, err error) {
	ref := previousRelease
	if v := os.Getenv("KVM_UPGRADE_FROM"); v != "" {
		ref = v
	}
	out, err := exec.Command("git", "-C", root, "rev-parse", "--verify", ref+"^{commit}").CombinedOutput()
	if err != nil {
		return "", "", fmt.Errorf("the previous release %s is not in this clone (a shallow clone? fetch its history): %v: %s", ref, err, out)
	}
	commit = strings.TrimSpace(string(out))
	home, err := os.UserCacheDir()
	if err != nil {
		return "", "", err
	}
	cache := filepath.Join(home, "kvmfleet")
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", "", err
	}
	bin = filepath.Join(cache, "kvmd-"+commit)
	lock, err := os.OpenFile(bin+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", "", err
	}
	defer func() { _ = lock.Close() }()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", "", err
	}
	if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() {
		return bin, commit, nil
	}
	tmp, err := os.MkdirTemp("", "kvmd-previous-")
	if err != nil {
		return "", "", err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	wt := filepath.Join(tmp, "src")
	if out, err := exec.Command("git", "-C", root, "worktree", "add", "--detach", wt, commit).CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("git worktree add %s: %v: %s", commit, err, out)
	}
	defer func() { _ = exec.Command("git", "-C", root, "worktree", "remove", "--force", wt).Run() }()
	if err := goBuild(wt, bin+".tmp", "-X main.version="+commit[:7]); err != nil {
		return "", "", err
	}
	return bin, commit, os.Rename(bin+".tmp", bin)
}

// freeAddress is a 127.0.0.1 port free a moment ago.
func freeAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// kvmdProc is one kvmd process (control or agent) of a test; restart runs
// it again on the same address and state with another binary, as an
// operator's upgrade does.
type kvmdProc struct {
	role string // "control" or "agent"
	bin  string
	args []string
	addr string
	url  string
	log  *os.File
	cmd  *exec.Cmd
	done chan struct{}
}

// startUpgradeControl starts `kvmd control` of bin on databaseURL with a
// short host monitor interval.
func startUpgradeControl(t *testing.T, bin, databaseURL string) *kvmdProc {
	t.Helper()
	addr := freeAddress(t)
	p := &kvmdProc{role: "control", bin: bin, addr: addr, url: "http://" + addr, args: []string{"control",
		"--listen", addr, "--token", "control-token", "--agent-token", "agent-token", "--log-level", "warn",
		"--database-url", databaseURL, "--sync-interval", "200ms", "--create-grace", "2s", "--orphan-grace", "2s"}}
	p.start(t)
	return p
}

// startUpgradeAgent starts `kvmd agent` of bin with the sim driver.
func startUpgradeAgent(t *testing.T, bin string) *kvmdProc {
	t.Helper()
	addr := freeAddress(t)
	p := &kvmdProc{role: "agent", bin: bin, addr: addr, url: "http://" + addr, args: []string{"agent",
		"--listen", addr, "--state-dir", t.TempDir(), "--driver", "sim", "--token", "agent-token",
		"--vcpus", "16", "--memory-mib", "32768", "--disk-mib", "200000", "--log-level", "warn"}}
	p.start(t)
	return p
}

func (p *kvmdProc) start(t *testing.T) {
	t.Helper()
	if p.log == nil {
		var err error
		if p.log, err = os.CreateTemp(t.TempDir(), "kvmd-"+p.role+"-*.log"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.stop(syscall.SIGKILL); _ = p.log.Close() })
	}
	fmt.Fprintf(p.log, "=== start %s\n", p.bin)
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")} // no KVMD_* from the caller's environment
	cmd.Stdout, cmd.Stderr = p.log, p.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start kvmd %s: %v", p.role, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.cmd, p.done = cmd, done
	path := "/healthz"
	if p.role == "control" {
		path = "/readyz"
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-done:
			out, _ := os.ReadFile(p.log.Name())
			t.Fatalf("kvmd %s (%s) exited:\n%s", p.role, p.bin, out)
		default:
		}
		resp, err := http.Get(p.url + path)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvmd %s on %s does not answer %s: %v", p.role, p.addr, path, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends the process with sig (SIGTERM: the graceful stop of an
// upgrade) and waits for it.
func (p *kvmdProc) stop(sig syscall.Signal) {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// restartAs stops the process gracefully and runs bin in its place (same
// address, state directory and database).
func (p *kvmdProc) restartAs(t *testing.T, bin string) {
	t.Helper()
	p.stop(syscall.SIGTERM)
	p.bin = bin
	p.start(t)
}

func (p *kvmdProc) client() *client.Client { return client.New(p.url, "control-token") }

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it returns nil, failing the test with its last
// error after a generous bound. It asserts no timing.
func waitFor(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting: %s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// registerAndSync registers each agent as host-<i> and waits until every
// host is alive with its capacity.
func registerAndSync(t *testing.T, ctx context.Context, c *client.Client, agents []*kvmdProc) map[string]*kvmdProc {
	t.Helper()
	byHost := map[string]*kvmdProc{}
	for i, a := range agents {
		name := fmt.Sprintf("host-%d", i)
		if _, err := c.PutHost(ctx, name, api.HostPut{Address: a.url}); err != nil {
			t.Fatalf("register %s (%s): %v", name, a.bin, err)
		}
		byHost[name] = a
	}
	waitFor(t, "every host alive", func() error { return allAlive(ctx, c) })
	return byHost
}

func allAlive(ctx context.Context, c *client.Client) error {
	hs, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	for _, h := range hs {
		if !h.Alive || h.Capacity.VCPUs == 0 {
			return fmt.Errorf("host %s not alive yet (refused: %q)", h.Name, h.AgentRefused)
		}
	}
	return nil
}

func upgradeVM(name string) api.VMCreate {
	return api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}
}

// fleetAgrees is the "nothing lost" check through the control API c and
// every agent's own list: no row left creating, each host's allocation
// is the sum of its VM rows, each agent runs exactly the VMs whose rows
// hold capacity on its host (so each VM is on exactly one agent), and each
// VM in want exists with the shape it was created with (a terraform plan
// of them would be empty).
func fleetAgrees(ctx context.Context, c *client.Client, agents map[string]*kvmdProc, want map[string]api.VMCreate) error {
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	sum := map[string]api.Resources{}
	rows := map[string][]string{}
	byID := map[string]api.VM{}
	var problems []string
	for _, vm := range vms {
		byID[vm.ID] = vm
		if vm.ObservedState == api.StateCreating {
			problems = append(problems, fmt.Sprintf("vm %s (%s) on %s is still creating", vm.ID, vm.Name, vm.Host))
		}
		if api.Gone(vm.ObservedState) {
			continue
		}
		s := sum[vm.Host]
		s.VCPUs += vm.VCPUs
		s.MemoryMiB += vm.MemoryMiB
		s.DiskMiB += vm.DiskMiB
		sum[vm.Host] = s
		rows[vm.Host] = append(rows[vm.Host], vm.ID)
	}
	onAgents := map[string][]string{}
	for _, h := range hosts {
		if h.Allocated != sum[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s: allocated %+v, its VM rows add up to %+v", h.Name, h.Allocated, sum[h.Name]))
		}
		a, ok := agents[h.Name]
		if !ok {
			continue
		}
		list, err := agentVMs(ctx, a.url)
		if err != nil {
			return fmt.Errorf("list VMs of the agent of %s: %w", h.Name, err)
		}
		for _, id := range list {
			onAgents[id] = append(onAgents[id], h.Name)
		}
		w := rows[h.Name]
		sort.Strings(list)
		sort.Strings(w)
		if strings.Join(list, ",") != strings.Join(w, ",") {
			problems = append(problems, fmt.Sprintf("host %s: agent runs %v, rows hold %v", h.Name, list, w))
		}
	}
	for id, in := range want {
		vm, ok := byID[id]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("vm %s (%s) was created and is gone", id, in.Name))
		case vm.Name != in.Name || vm.VCPUs != in.VCPUs || vm.MemoryMiB != in.MemoryMiB || vm.DiskMiB != in.DiskMiB ||
			vm.ObservedState != api.StateRunning:
			problems = append(problems, fmt.Sprintf("vm %s: %s %d vCPU %d MiB %d MiB %s, created as %s %d %d %d running: a plan would not be empty",
				id, vm.Name, vm.VCPUs, vm.MemoryMiB, vm.DiskMiB, vm.ObservedState, in.Name, in.VCPUs, in.MemoryMiB, in.DiskMiB))
		case len(onAgents[id]) != 1:
			problems = append(problems, fmt.Sprintf("vm %s is on agents %v, want exactly one", id, onAgents[id]))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// postgres is a fresh database on KVM_TEST_DATABASE_URL's server (or a
// throwaway server).
func postgres(t *testing.T) string { return testenv.PostgresURL(t) }
