package faulttest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// The volume steps of issue 26 under kill -9: `kvmd control` or `kvmd
// agent` (both real processes) is killed while a step's agent call is
// held at a gate in front of the agent, once before the agent saw the
// call and once after the agent did its work but before its answer came
// back. After a restart, the rows, each host's allocation (VMs plus
// volumes) and the agent's own volumes and VMs (GET /v1/volumes, GET
// /v1/vms) agree, nothing is lost or leaked, and a second run of the step
// completes.

// volumeStep is one step of a volume's life with its agent call.
type volumeStep struct {
	name string
	// matches is the agent call the kill happens at.
	matches func(r *http.Request) bool
	// prepare makes what the step needs (through the control API) and
	// returns the step's run; retry runs the step a second time after the
	// restart and checks that it completed.
	prepare func(t *testing.T, ctx context.Context, c *client.Client) (run func(c *client.Client) error, retry func(t *testing.T, c *client.Client))
}

func isCall(method, prefix, suffix string) func(r *http.Request) bool {
	return func(r *http.Request) bool {
		return r.Method == method && strings.HasPrefix(r.URL.Path, prefix) && strings.HasSuffix(r.URL.Path, suffix) &&
			len(r.URL.Path) > len(prefix)
	}
}

// volumeSteps are the steps: create, resize, delete of a volume, and the
// create and delete of a VM that has one attached.
func volumeSteps() []volumeStep {
	return []volumeStep{
		{
			name: "volume create", matches: isCall(http.MethodPut, "/v1/volumes/", ""),
			prepare: func(t *testing.T, ctx context.Context, c *client.Client) (func(*client.Client) error, func(*testing.T, *client.Client)) {
				in := api.VolumeCreate{Name: "data", SizeMiB: 2048, Host: "h1"}
				run := func(c *client.Client) error { _, err := c.CreateVolume(ctx, in); return err }
				return run, func(t *testing.T, c *client.Client) {
					// The create was cut off: it was undone (its name is
					// free) or, never, finished; either way a retry ends
					// with the volume there.
					if v, err := c.GetVolume(ctx, in.Name); err == nil {
						t.Logf("the cut-off create was finished: volume %s is %s", v.ID, v.State)
						return
					}
					if err := run(c); err != nil {
						t.Fatalf("second run of the volume create: %v", err)
					}
					t.Logf("the cut-off create was undone; its second run made the volume")
				}
			},
		},
		{
			name: "volume resize", matches: isCall(http.MethodPost, "/v1/volumes/", "/resize"),
			prepare: func(t *testing.T, ctx context.Context, c *client.Client) (func(*client.Client) error, func(*testing.T, *client.Client)) {
				mustCreateVolume(t, ctx, c, "data", 1024)
				size := int64(3072)
				run := func(c *client.Client) error {
					_, err := c.UpdateVolume(ctx, "data", api.VolumePatch{SizeMiB: &size})
					return err
				}
				return run, func(t *testing.T, c *client.Client) {
					if err := run(c); err != nil {
						t.Fatalf("second run of the volume resize: %v", err)
					}
					if v, err := c.GetVolume(ctx, "data"); err != nil || v.SizeMiB != size {
						t.Fatalf("after the second resize: %+v, %v; want %d MiB", v, err, size)
					}
				}
			},
		},
		{
			name: "volume delete", matches: isCall(http.MethodDelete, "/v1/volumes/", ""),
			prepare: func(t *testing.T, ctx context.Context, c *client.Client) (func(*client.Client) error, func(*testing.T, *client.Client)) {
				mustCreateVolume(t, ctx, c, "data", 1024)
				run := func(c *client.Client) error { return c.DeleteVolume(ctx, "data") }
				return run, func(t *testing.T, c *client.Client) {
					if err := run(c); err != nil && !errors.Is(err, client.ErrNotFound) {
						t.Fatalf("second run of the volume delete: %v", err)
					}
					if _, err := c.GetVolume(ctx, "data"); !errors.Is(err, client.ErrNotFound) {
						t.Fatalf("volume still there after the second delete: %v", err)
					}
				}
			},
		},
		{
			name: "vm create with a volume", matches: isCall(http.MethodPut, "/v1/vms/", ""),
			prepare: func(t *testing.T, ctx context.Context, c *client.Client) (func(*client.Client) error, func(*testing.T, *client.Client)) {
				vol := mustCreateVolume(t, ctx, c, "data", 1024)
				in := smallVM("db")
				in.Volumes = []api.VMVolume{{Volume: "data"}}
				run := func(c *client.Client) error { _, err := c.CreateVM(ctx, in, ""); return err }
				return run, func(t *testing.T, c *client.Client) {
					if vmNamed(ctx, t, c, "db") == nil {
						if err := run(c); err != nil {
							t.Fatalf("second run of the VM create: %v", err)
						}
					}
					vm := vmNamed(ctx, t, c, "db")
					if vm == nil || len(vm.Volumes) != 1 || vm.Volumes[0].VolumeID != vol.ID {
						t.Fatalf("VM db after the second create: %+v; want volume %s attached", vm, vol.ID)
					}
				}
			},
		},
		{
			name: "vm delete detaches", matches: isCall(http.MethodDelete, "/v1/vms/", ""),
			prepare: func(t *testing.T, ctx context.Context, c *client.Client) (func(*client.Client) error, func(*testing.T, *client.Client)) {
				mustCreateVolume(t, ctx, c, "data", 1024)
				in := smallVM("db")
				in.Volumes = []api.VMVolume{{Volume: "data"}}
				vm, err := c.CreateVM(ctx, in, "")
				if err != nil {
					t.Fatal(err)
				}
				run := func(c *client.Client) error { return c.DeleteVM(ctx, vm.ID) }
				return run, func(t *testing.T, c *client.Client) {
					if err := run(c); err != nil && !errors.Is(err, client.ErrNotFound) {
						t.Fatalf("second run of the VM delete: %v", err)
					}
					// Detached: the volume can go now.
					if err := c.DeleteVolume(ctx, "data"); err != nil {
						t.Fatalf("delete the volume after its VM went: %v", err)
					}
				}
			},
		},
	}
}

func mustCreateVolume(t *testing.T, ctx context.Context, c *client.Client, name string, sizeMiB int64) api.Volume {
	t.Helper()
	var v api.Volume
	eventually(t, "the host takes volume "+name, func() error {
		var err error
		v, err = c.CreateVolume(ctx, api.VolumeCreate{Name: name, SizeMiB: sizeMiB, Host: "h1"})
		return err
	})
	return v
}

func vmNamed(ctx context.Context, t *testing.T, c *client.Client, name string) *api.VM {
	t.Helper()
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range vms {
		if vm.Name == name {
			return &vm
		}
	}
	return nil
}

// TestKill9ControlDuringVolumeSteps kills `kvmd control` at each volume
// step and restarts it on the same database.
func TestKill9ControlDuringVolumeSteps(t *testing.T) {
	bin := buildKVMD(t)
	for _, step := range volumeSteps() {
		for _, at := range []killPoint{beforeAgent, afterAgent} {
			t.Run(fmt.Sprintf("%s/%s", step.name, at), func(t *testing.T) {
				t.Run("sqlite", func(t *testing.T) { kill9ControlDuringVolumeStep(t, bin, "", t.TempDir(), step, at) })
				t.Run("postgres", func(t *testing.T) { kill9ControlDuringVolumeStep(t, bin, testenv.PostgresURL(t), "", step, at) })
			})
		}
	}
}

// TestKill9AgentDuringVolumeSteps kills `kvmd agent` at each volume step
// and restarts it on the same state directory and address.
func TestKill9AgentDuringVolumeSteps(t *testing.T) {
	bin := buildKVMD(t)
	for _, step := range volumeSteps() {
		for _, at := range []killPoint{beforeAgent, duringAgent, afterAgent} {
			t.Run(fmt.Sprintf("%s/%s", step.name, at), func(t *testing.T) {
				t.Run("sqlite", func(t *testing.T) { kill9AgentDuringVolumeStep(t, bin, "", t.TempDir(), step, at) })
				t.Run("postgres", func(t *testing.T) { kill9AgentDuringVolumeStep(t, bin, testenv.PostgresURL(t), "", step, at) })
			})
		}
	}
}

// killPoint is where in a step's agent call the kill happens.
type killPoint int

const (
	beforeAgent killPoint = iota // the agent never saw the call
	duringAgent                  // the agent got the call and works on it (agent kills only)
	afterAgent                   // the agent did it; its answer never came back
)

func (k killPoint) String() string {
	return [...]string{"before the agent saw it", "while the agent works", "after the agent did it"}[k]
}

func kill9ControlDuringVolumeStep(t *testing.T, bin, databaseURL, dataDir string, step volumeStep, at killPoint) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	ag := startKVMDAgent(t, bin)
	gate := startStepGate(t, ag.url, step.matches)
	ag.advertise(t, gate.url)
	registerAndSync(t, ctx, k.client(true), gate.url)
	run, retry := step.prepare(t, ctx, k.client(true))

	gate.arm(at, nil)
	answered := make(chan error, 1)
	go func() { answered <- run(k.client(false)) }()
	select {
	case <-gate.reached:
	case err := <-answered:
		t.Fatalf("the step answered (%v) before its agent call reached the gate", err)
	case <-ctx.Done():
		t.Fatal("the step's agent call never reached the gate")
	}
	k.kill()
	if err := <-answered; err == nil {
		t.Fatal("the step answered success although kvmd control was killed before it finished")
	}

	k2 := startKVMD(t, bin, databaseURL, dataDir)
	c2 := k2.client(true)
	eventually(t, "the restarted control plane settles the step", func() error { return volumeLedger(ctx, c2, ag.client) })
	retry(t, c2)
	eventually(t, "rows, allocation and the agent agree after the second run", func() error { return volumeLedger(ctx, c2, ag.client) })
}

func kill9AgentDuringVolumeStep(t *testing.T, bin, databaseURL, dataDir string, step volumeStep, at killPoint) {
	ctx := ctxT(t, 2*time.Minute)
	k := startKVMD(t, bin, databaseURL, dataDir)
	ag := startKVMDAgent(t, bin)
	gate := startStepGate(t, ag.url, step.matches)
	ag.advertise(t, gate.url)
	registerAndSync(t, ctx, k.client(true), gate.url)
	run, retry := step.prepare(t, ctx, k.client(true))

	gate.arm(at, ag.kill)
	err := run(k.client(false))
	select {
	case <-gate.reached:
	default:
		t.Fatalf("the step answered (%v) without its agent call reaching the gate", err)
	}
	if err == nil {
		t.Fatal("the step answered success although its agent was killed before answering")
	}
	t.Logf("the step answered: %v", err)
	ag.restart(t)

	c := k.client(true)
	eventually(t, "the control plane settles the step once the agent is back", func() error { return volumeLedger(ctx, c, ag.client) })
	retry(t, c)
	eventually(t, "rows, allocation and the agent agree after the second run", func() error { return volumeLedger(ctx, c, ag.client) })
}

// registerAndSync registers host h1 at address and waits until the host
// monitor has seen it.
func registerAndSync(t *testing.T, ctx context.Context, c *client.Client, address string) {
	t.Helper()
	if _, err := c.PutHost(ctx, "h1", api.HostPut{Address: address}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the monitor has seen h1", func() error {
		h, err := c.GetHost(ctx, "h1")
		if err != nil {
			return err
		}
		if !h.Alive || h.Capacity.DiskMiB == 0 {
			return fmt.Errorf("host h1 not synced yet")
		}
		return nil
	})
}

// volumeLedger checks through the control API and the agent's own API
// that no host is over capacity; that each host's allocation equals its
// VM rows that hold capacity plus its volume rows; that no VM is creating
// and no volume creating or deleting; that the agent runs exactly the VMs
// and has exactly the ready volumes of the rows, each volume of the row's
// size and attached (read-write) to the VM the row names (none when that
// VM is missing from its agent: its row keeps the volume until it is
// deleted, in case it comes back).
func volumeLedger(ctx context.Context, c *client.Client, ag *agentapi.Client) error {
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	vols, err := allVolumes(ctx, c)
	if err != nil {
		return err
	}
	sum := map[string]api.Resources{}
	var vmRows []string
	gone := map[string]bool{}
	for _, vm := range vms {
		if vm.ObservedState == api.StateCreating {
			return fmt.Errorf("vm %s (%s) is still creating", vm.ID, vm.Name)
		}
		if api.Gone(vm.ObservedState) {
			gone[vm.ID] = true
			continue
		}
		s := sum[vm.Host]
		s.VCPUs, s.MemoryMiB, s.DiskMiB = s.VCPUs+vm.VCPUs, s.MemoryMiB+vm.MemoryMiB, s.DiskMiB+vm.DiskMiB
		sum[vm.Host] = s
		vmRows = append(vmRows, vm.ID)
	}
	type volRow struct {
		size int64
		rw   string
	}
	volRows := map[string]volRow{}
	for _, v := range vols {
		if v.State != api.VolumeReady {
			return fmt.Errorf("volume %s (%s) is %s (%s)", v.ID, v.Name, v.State, v.Reason)
		}
		s := sum[v.Host]
		s.DiskMiB += v.SizeMiB
		sum[v.Host] = s
		r := volRow{size: v.SizeMiB}
		for _, a := range v.AttachedTo {
			// A VM missing from its agent (a delete cut off after the
			// agent's part) keeps its volumes in the rows until its row
			// is deleted, in case it comes back; on the agent it has none.
			if !a.ReadOnly && !gone[a.VMID] {
				r.rw = a.VMID
			}
		}
		volRows[v.ID] = r
	}
	var problems []string
	for _, h := range hosts {
		a, cp := h.Allocated, h.Capacity
		if a.VCPUs > cp.VCPUs || a.MemoryMiB > cp.MemoryMiB || a.DiskMiB > cp.DiskMiB {
			problems = append(problems, fmt.Sprintf("host %s over capacity: allocated %+v, capacity %+v", h.Name, a, cp))
		}
		if a != sum[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s: allocated %+v, its VM and volume rows add up to %+v", h.Name, a, sum[h.Name]))
		}
	}
	onAgent, err := ag.ListVMs(ctx)
	if err != nil {
		return fmt.Errorf("list the agent's VMs: %w", err)
	}
	var agentVMs []string
	for _, v := range onAgent {
		agentVMs = append(agentVMs, v.ID)
	}
	slices.Sort(agentVMs)
	slices.Sort(vmRows)
	if !slices.Equal(agentVMs, vmRows) {
		problems = append(problems, fmt.Sprintf("the agent runs VMs %v, the rows hold %v", agentVMs, vmRows))
	}
	agentVols, err := ag.ListVolumes(ctx)
	if err != nil {
		return fmt.Errorf("list the agent's volumes: %w", err)
	}
	seen := map[string]bool{}
	for _, v := range agentVols {
		seen[v.ID] = true
		r, ok := volRows[v.ID]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("the agent has volume %s (%d MiB) that no row names", v.ID, v.SizeMiB))
		case r.size != v.SizeMiB:
			problems = append(problems, fmt.Sprintf("volume %s: %d MiB in its row, %d MiB on the agent", v.ID, r.size, v.SizeMiB))
		case r.rw != v.AttachedTo:
			problems = append(problems, fmt.Sprintf("volume %s: attached to %q in its row, to %q on the agent", v.ID, r.rw, v.AttachedTo))
		}
	}
	for id := range volRows {
		if !seen[id] {
			problems = append(problems, fmt.Sprintf("volume %s has a ready row, the agent does not have it", id))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func allVolumes(ctx context.Context, c *client.Client) ([]api.Volume, error) {
	var out []api.Volume
	token := ""
	for range 100 {
		page, err := c.ListVolumes(ctx, 0, token)
		if err != nil {
			return nil, err
		}
		out = append(out, page.Items...)
		if token = page.NextPageToken; token == "" {
			return out, nil
		}
	}
	return nil, errors.New("list volumes: more than 100 pages")
}

// stepGate sits between kvmd control and an agent. Once armed, the first
// call that matches is held at its kill point: not forwarded (before),
// forwarded and killed as soon as the agent has the whole request
// (during), or forwarded and answered by the agent (after); then reached
// is closed. With a kill function (the agent's), the gate kills the agent
// there and drops the connection, as an agent that dies at that point
// does; without one, it holds the call until its caller goes away (kvmd
// control killed). Every other call passes.
type stepGate struct {
	url     string
	matches func(*http.Request) bool
	reached chan struct{}
	stop    chan struct{}

	mu    sync.Mutex
	armed bool
	at    killPoint
	kill  func()
}

func startStepGate(t *testing.T, agentURL string, matches func(*http.Request) bool) *stepGate {
	t.Helper()
	g := &stepGate{matches: matches, reached: make(chan struct{}), stop: make(chan struct{})}
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		hold := g.armed && g.matches(r)
		if hold {
			g.armed = false
		}
		at, kill := g.at, g.kill
		g.mu.Unlock()
		if !hold {
			proxy.ServeHTTP(w, r)
			return
		}
		switch at {
		case afterAgent:
			// The agent does the work whatever happens to the caller.
			proxy.ServeHTTP(httptest.NewRecorder(), r.WithContext(context.WithoutCancel(r.Context())))
		case duringAgent:
			// The kill comes once the agent has the whole request, while
			// its handler works (or has just finished: any outcome must
			// leave the ledger agreeing).
			sent := make(chan struct{})
			var once sync.Once
			trace := &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { once.Do(func() { close(sent) }) }}
			fwd := r.WithContext(httptrace.WithClientTrace(context.WithoutCancel(r.Context()), trace))
			done := make(chan struct{})
			go func() { defer close(done); proxy.ServeHTTP(httptest.NewRecorder(), fwd) }()
			select {
			case <-sent:
			case <-done:
			}
		default:
			// Read to the end, so that the server notices the caller hang up.
			_, _ = io.Copy(io.Discard, r.Body)
		}
		if kill != nil {
			kill()
			close(g.reached)
			panic(http.ErrAbortHandler) // the connection drops without an answer
		}
		close(g.reached)
		select {
		case <-r.Context().Done():
		case <-g.stop:
		}
	}))
	t.Cleanup(func() { close(g.stop); srv.Close() })
	g.url = srv.URL
	return g
}

// arm makes the gate hold the next matching call at kill point at.
func (g *stepGate) arm(at killPoint, kill func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed, g.at, g.kill = true, at, kill
}

// kvmdAgent is `kvmd agent` with the sim driver running as a child
// process on a fixed state directory and address.
type kvmdAgent struct {
	bin, stateDir, listen, url string
	advertised                 string
	env                        []string // more environment of the process, beside PATH
	client                     *agentapi.Client
	cmd                        *exec.Cmd
	done                       chan struct{}
	log                        *os.File
	killed                     atomic.Bool
}

func startKVMDAgent(t *testing.T, bin string) *kvmdAgent {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	a := newKVMDAgent(t, bin, addr, "")
	a.client = agentapi.NewClient(a.url, "agent-token")
	a.start(t)
	return a
}

// startKVMDAgentAt is startKVMDAgent on a given address, also proving its
// identity for advertise when it is not "" (a gate in front of it); its
// client does not retry, so a test sees each call's own answer.
func startKVMDAgentAt(t *testing.T, bin, addr, advertise string) *kvmdAgent {
	t.Helper()
	a := newKVMDAgent(t, bin, addr, advertise)
	a.client = agentapi.NewClient(a.url, "agent-token", agentapi.WithRetries(0))
	a.start(t)
	return a
}

func newKVMDAgent(t *testing.T, bin, addr, advertise string) *kvmdAgent {
	t.Helper()
	a := &kvmdAgent{bin: bin, stateDir: t.TempDir(), listen: addr, url: "http://" + addr, advertised: advertise}
	logDir := t.TempDir()
	if d := os.Getenv(LogDirEnv); d != "" {
		logDir = d
	}
	var err error
	if a.log, err = os.CreateTemp(logDir, "kvmd-agent-*.log"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.kill(); _ = a.log.Close() })
	return a
}

// advertise restarts the agent so that it also proves its identity for
// address (a gate in front of it).
func (a *kvmdAgent) advertise(t *testing.T, address string) {
	t.Helper()
	a.advertised = address
	a.kill()
	a.start(t)
}

func (a *kvmdAgent) start(t *testing.T) {
	t.Helper()
	args := []string{"agent", "--listen", a.listen, "--state-dir", a.stateDir, "--driver", "sim", "--token", "agent-token",
		"--vcpus", "8", "--memory-mib", "16384", "--disk-mib", "100000", "--log-level", "warn"}
	if a.advertised != "" {
		args = append(args, "--advertise-url", a.advertised)
	}
	var err error
	for range 50 { // the port was just released; another process could take it
		cmd := exec.Command(a.bin, args...)
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, a.env...)
		cmd.Stdout, cmd.Stderr = a.log, a.log
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err = cmd.Start(); err != nil {
			t.Fatalf("start kvmd agent: %v", err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		a.cmd, a.done = cmd, done
		a.killed.Store(false)
		if err = a.awaitHealthy(done); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	out, _ := os.ReadFile(a.log.Name())
	t.Fatalf("kvmd agent on %s does not answer: %v; log:\n%s", a.listen, err, out)
}

func (a *kvmdAgent) awaitHealthy(done chan struct{}) error {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return errors.New("kvmd agent exited")
		default:
		}
		resp, err := http.Get(a.url + "/healthz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(25 * time.Millisecond)
	}
	return errors.New("no answer on /healthz")
}

// kill sends SIGKILL and waits until the process is gone.
func (a *kvmdAgent) kill() {
	if a.cmd == nil || a.killed.Swap(true) {
		return
	}
	_ = a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.done
}

// restart starts the agent again on the same state directory and address.
func (a *kvmdAgent) restart(t *testing.T) {
	t.Helper()
	a.kill()
	a.start(t)
}
