package bench

// Create latency through the control API, warm vs cold (issue 6), in one run:
//
//	go test ./bench -run '^$' -bench 'CreateLatencyQEMU' -benchtime 1x -timeout 20m
//
// An in-process control API (SQLite) with one real QEMU agent (TCG here).
// Each sample is POST /v1/vms until its answer, for the busybox guest at
// 128 MiB:
//   - cold-p50/p95-ms: 20 creates with no warm pool (the answer comes once
//     QEMU runs; the guest boots after),
//   - warm-p50/p95-ms: 20 creates that each take a warm VM, in batches of 4:
//     the pool (size 4) is refilled and all 4 ready before each batch,
//   - cold/warm: the ratio of the p50s,
//   - resume-p50/p95-ms: the agent-side resume, QMP cont on a paused guest
//     (fresh QMP session per call as the agent does it), 20 samples on the
//     warm-started VMs,
//   - warm-<step>-p50-ms: where a warm create's time goes, from the answer's
//     Server-Timing header (decode, idempotency-claim, checks, placement,
//     image, agent, record, idempotency-complete; agent.* are the agent's
//     own steps inside agent: checks, take, handover (nice, resume,
//     observe, journal, move), log, and handler, all of its
//     create) and warm-rest-p50-ms, the rest of the round trip (HTTP,
//     encoding the answer, the client),
//   - single-p50-ms, burst3-p50/p95-ms, burst3-par-p50/p95-ms: warm
//     creates on a full pool whose boots ended: one alone, then 3 right
//     after each other (one client), then 3 at once (3 clients, as
//     Terraform's parallelism sends them), 5 rounds each; burst-boots is
//     how many refill boots the pool had started when a burst's last
//     create answered (summed over the rounds: 0 means no replacement
//     boot met a burst), burst3-agent-p50-ms the agent's own time of the
//     sequential bursts' creates (Server-Timing agent).
//
// Numbers are reported, never asserted. Every VM is deleted before the next
// batch so that idle guests do not steal the CPU from the measured creates.

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

const (
	latencyRuns     = 20
	latencyPoolSize = 4
	burstRounds     = 5
	burstSize       = 3
)

var latencyVM = api.VMCreate{Image: benchGuest.Image, VCPUs: benchGuest.VCPUs, MemoryMiB: benchGuest.MemoryMiB, DiskMiB: benchGuest.DiskMiB}

func latencyPool(size int) []api.WarmPoolTarget {
	return []api.WarmPoolTarget{{Image: latencyVM.Image, VCPUs: latencyVM.VCPUs, MemoryMiB: latencyVM.MemoryMiB, DiskMiB: latencyVM.DiskMiB, Size: size}}
}

// waitReady waits until the agent has n ready warm VMs of the shape.
func waitReady(b *testing.B, c *agentapi.Client, n int) {
	deadline := time.Now().Add(5 * time.Minute)
	for time.Now().Before(deadline) {
		items, err := c.Pool(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for _, it := range items {
			if it.Image == latencyVM.Image && it.VCPUs == latencyVM.VCPUs && it.MemoryMiB == latencyVM.MemoryMiB &&
				it.DiskMiB == latencyVM.DiskMiB && it.Ready >= n {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	b.Fatalf("fewer than %d ready warm VMs within 5 minutes", n)
}

func BenchmarkCreateLatencyQEMU(b *testing.B) {
	defer machineState(b)()
	ctl := testenv.StartControl(b, testenv.ControlOptions{})
	ag := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu"})
	ctx := context.Background()
	ratio := 8.0
	put := func(size int) {
		in := api.HostPut{Address: ag.Address, CPUAllocationRatio: &ratio}
		if size > 0 {
			in.WarmPool = latencyPool(size)
		}
		if _, err := ctl.Client.PutHost(ctx, "q1", in); err != nil {
			b.Fatal(err)
		}
	}
	timings := &serverTimingTransport{}
	cl := client.New(ctl.URL, ctl.Token, client.WithTimeout(time.Minute), client.WithHTTPClient(&http.Client{Transport: timings}))
	create := func(name, from string) (api.VM, time.Duration) {
		in := latencyVM
		in.Name = name
		t0 := time.Now()
		vm, err := cl.CreateVM(ctx, in, "")
		d := time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		if vm.StartedFrom != from || vm.ObservedState != api.StateRunning {
			b.Fatalf("create %s: started_from %q, state %q; want %s and running", name, vm.StartedFrom, vm.ObservedState, from)
		}
		return vm, d
	}
	del := func(id string) {
		if err := ctl.Client.DeleteVM(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
	info, err := ag.Client.Info(ctx)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("accel %s (%s)", info.Accel, info.AccelNote)
	for b.Loop() {
		var cold, warm, resume []time.Duration
		steps := map[string][]time.Duration{}
		put(0)
		for i := range latencyRuns {
			vm, d := create(fmt.Sprintf("cold-%d", i), api.StartedCold)
			cold = append(cold, d)
			del(vm.ID)
		}
		put(latencyPoolSize)
		for i := 0; i < latencyRuns; i += latencyPoolSize {
			waitReady(b, ag.Client, latencyPoolSize)
			var batch []api.VM
			for j := i; j < min(i+latencyPoolSize, latencyRuns); j++ {
				vm, d := create(fmt.Sprintf("warm-%d", j), api.StartedWarm)
				warm = append(warm, d)
				batch = append(batch, vm)
				rest := d
				for _, st := range timings.last() {
					steps[st.Name] = append(steps[st.Name], st.Duration)
					if !strings.Contains(st.Name, ".") { // agent.* are inside agent
						rest -= st.Duration
					}
				}
				steps["rest"] = append(steps["rest"], rest)
			}
			// The agent-side resume on these guests: pause, then time QMP cont.
			for _, vm := range batch {
				if _, err := ag.Client.Action(ctx, vm.ID, agentapi.ActionPause); err != nil {
					b.Fatal(err)
				}
				s := openQMP(b, filepath.Join(ag.StateDir, "vms", vm.ID, "qmp.sock"))
				t0 := time.Now()
				s.call(b, "cont")
				resume = append(resume, time.Since(t0))
				_ = s.conn.Close()
				del(vm.ID)
			}
		}
		var single, seq, par, seqAgent []time.Duration
		boots := 0
		booting := func() int {
			items, err := ag.Client.Pool(ctx)
			if err != nil {
				b.Fatal(err)
			}
			n := 0
			for _, it := range items {
				n += it.Booting
			}
			return n
		}
		for r := range burstRounds {
			waitReady(b, ag.Client, latencyPoolSize)
			vm, d := create(fmt.Sprintf("single-%d", r), api.StartedWarm)
			single = append(single, d)
			del(vm.ID)
			waitReady(b, ag.Client, latencyPoolSize)
			var ids []string
			for j := range burstSize {
				vm, d := create(fmt.Sprintf("seq-%d-%d", r, j), api.StartedWarm)
				seq = append(seq, d)
				ids = append(ids, vm.ID)
				for _, st := range timings.last() {
					if st.Name == "agent" {
						seqAgent = append(seqAgent, st.Duration)
					}
				}
			}
			boots += booting()
			for _, id := range ids {
				del(id)
			}
			waitReady(b, ag.Client, latencyPoolSize)
			var mu sync.Mutex
			var wg sync.WaitGroup
			var errs []error
			ids = nil
			for j := range burstSize {
				wg.Go(func() {
					in := latencyVM
					in.Name = fmt.Sprintf("par-%d-%d", r, j)
					t0 := time.Now()
					vm, err := cl.CreateVM(ctx, in, "")
					d := time.Since(t0)
					mu.Lock()
					defer mu.Unlock()
					if err != nil || vm.StartedFrom != api.StartedWarm {
						errs = append(errs, fmt.Errorf("create %s: started_from %q: %v", in.Name, vm.StartedFrom, err))
					}
					if err == nil {
						par = append(par, d)
						ids = append(ids, vm.ID)
					}
				})
			}
			wg.Wait()
			if len(errs) > 0 {
				b.Fatal(errs)
			}
			boots += booting()
			for _, id := range ids {
				del(id)
			}
		}
		put(0)
		b.ReportMetric(pct(single, 50), "single-p50-ms")
		b.ReportMetric(pct(seq, 50), "burst3-p50-ms")
		b.ReportMetric(pct(seq, 95), "burst3-p95-ms")
		b.ReportMetric(pct(par, 50), "burst3-par-p50-ms")
		b.ReportMetric(pct(par, 95), "burst3-par-p95-ms")
		b.ReportMetric(pct(seqAgent, 50), "burst3-agent-p50-ms")
		b.ReportMetric(float64(boots), "burst-boots")
		b.ReportMetric(pct(cold, 50), "cold-p50-ms")
		b.ReportMetric(pct(cold, 95), "cold-p95-ms")
		b.ReportMetric(pct(warm, 50), "warm-p50-ms")
		b.ReportMetric(pct(warm, 95), "warm-p95-ms")
		b.ReportMetric(pct(cold, 50)/pct(warm, 50), "cold/warm")
		b.ReportMetric(pct(resume, 50), "resume-p50-ms")
		b.ReportMetric(pct(resume, 95), "resume-p95-ms")
		for name, ds := range steps {
			b.ReportMetric(pct(ds, 50), "warm-"+name+"-p50-ms")
		}
	}
}

// serverTimingTransport keeps the Server-Timing steps of the last answer.
type serverTimingTransport struct {
	mu    sync.Mutex
	steps []timing.Step
}

func (t *serverTimingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.steps = timing.Parse(resp.Header.Get("Server-Timing"))
	t.mu.Unlock()
	return resp, nil
}

func (t *serverTimingTransport) last() []timing.Step {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.steps
}
