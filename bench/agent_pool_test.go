package bench

// Warm pool measurements at the agent (docs/guides/architecture.md), in one run:
//
//	go test ./bench -run '^$' -bench 'AgentPool' -benchtime 1x -timeout 30m
//
// BenchmarkAgentPoolQEMU (real guests, TCG here):
//   - warm-p50/p95-ms: PUT /v1/vms/{id} that takes a warm VM (20 runs; the
//     guest is up when the PUT returns),
//   - cold-p50/p95-ms: PUT of a cold create (NoWarm; returns once QEMU
//     answers), and cold-ready-p50-ms: until the guest's ready line,
//   - resume-p50/p95-ms: QMP cont on a paused guest, a fresh QMP session
//     per call as the agent does it (connect, greeting, capabilities, cont),
//   - cold-ready/warm and cold/warm: the ratios.
//
// BenchmarkAgentPoolSim: the same warm and cold PUTs with the sim driver,
// the agent's own cost (registry and metadata writes, fsynced).
// Numbers are reported, never asserted.

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const (
	poolWarmRuns = 20
	poolColdRuns = 5
)

// waitWarm waits until the pool has a ready warm VM of spec's shape.
func waitWarm(b *testing.B, c *agentapi.Client, spec agentapi.VMSpec) {
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		items, err := c.Pool(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for _, it := range items {
			if it.Image == spec.Image && it.VCPUs == spec.VCPUs && it.MemoryMiB == spec.MemoryMiB && it.DiskMiB == spec.DiskMiB && it.Ready > 0 {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.Fatal("no ready warm vm within 3 minutes")
}

func setPool(b *testing.B, c *agentapi.Client, spec agentapi.VMSpec, size int) {
	_, err := c.SetPool(context.Background(), spec.Image, agentapi.PoolPut{Shapes: []agentapi.PoolShape{
		{VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB, DiskMiB: spec.DiskMiB, Size: size}}})
	if err != nil {
		b.Fatal(err)
	}
}

// createTimed runs one PUT and checks how the VM started.
func createTimed(b *testing.B, c *agentapi.Client, id string, spec agentapi.VMSpec, from string) time.Duration {
	t0 := time.Now()
	vm, err := c.CreateVM(context.Background(), id, spec)
	d := time.Since(t0)
	if err != nil {
		b.Fatal(err)
	}
	if vm.StartedFrom != from || vm.State != agentapi.StateRunning {
		b.Fatalf("create %s = %+v, want running, started %s", id, vm, from)
	}
	return d
}

func BenchmarkAgentPoolQEMU(b *testing.B) {
	defer machineState(b)()
	a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu"})
	ctx := context.Background()
	info, err := a.Client.Info(ctx)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("accel %s (%s)", info.Accel, info.AccelNote)
	cold := benchGuest
	cold.NoWarm = true
	for b.Loop() {
		var warm, coldPut, coldReady, resume []time.Duration
		// Cold first, with the pool empty: no warm boot competes for CPU.
		for i := 0; i < poolColdRuns; i++ {
			id := fmt.Sprintf("cold-%d", i)
			t0 := time.Now()
			coldPut = append(coldPut, createTimed(b, a.Client, id, cold, agentapi.StartedCold))
			t1, _ := waitLine(b, filepath.Join(a.StateDir, "vms", id, "console.log"), readyLine)
			coldReady = append(coldReady, t1.Sub(t0))
			// The resume itself, on this running guest paused by the agent.
			if _, err := a.Client.Action(ctx, id, agentapi.ActionPause); err != nil {
				b.Fatal(err)
			}
			sock := filepath.Join(a.StateDir, "vms", id, "qmp.sock")
			for j := 0; j < poolWarmRuns/poolColdRuns; j++ {
				t2 := time.Now()
				s := openQMP(b, sock)
				s.call(b, "cont")
				resume = append(resume, time.Since(t2))
				s.call(b, "stop")
				_ = s.conn.Close()
			}
			if err := a.Client.DeleteVM(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
		setPool(b, a.Client, benchGuest, 2)
		for i := 0; i < poolWarmRuns; i++ {
			waitWarm(b, a.Client, benchGuest)
			id := fmt.Sprintf("warm-%d", i)
			warm = append(warm, createTimed(b, a.Client, id, benchGuest, agentapi.StartedWarm))
			if err := a.Client.DeleteVM(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
		setPool(b, a.Client, benchGuest, 0)
		b.ReportMetric(pct(warm, 50), "warm-p50-ms")
		b.ReportMetric(pct(warm, 95), "warm-p95-ms")
		b.ReportMetric(pct(coldPut, 50), "cold-p50-ms")
		b.ReportMetric(pct(coldPut, 95), "cold-p95-ms")
		b.ReportMetric(pct(coldReady, 50), "cold-ready-p50-ms")
		b.ReportMetric(pct(coldReady, 95), "cold-ready-p95-ms")
		b.ReportMetric(pct(resume, 50), "resume-p50-ms")
		b.ReportMetric(pct(resume, 95), "resume-p95-ms")
		b.ReportMetric(pct(coldReady, 50)/pct(warm, 50), "cold-ready/warm")
		b.ReportMetric(pct(coldPut, 50)/pct(warm, 50), "cold/warm")
	}
}

func BenchmarkAgentPoolSim(b *testing.B) {
	defer machineState(b)()
	a := testenv.StartAgent(b, testenv.AgentOptions{})
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}
	cold := spec
	cold.NoWarm = true
	ctx := context.Background()
	round := 0
	for b.Loop() {
		round++
		var warm, coldPut []time.Duration
		setPool(b, a.Client, spec, 2)
		for i := 0; i < poolWarmRuns; i++ {
			waitWarm(b, a.Client, spec)
			id := fmt.Sprintf("r%d-warm-%d", round, i)
			warm = append(warm, createTimed(b, a.Client, id, spec, agentapi.StartedWarm))
			coldPut = append(coldPut, createTimed(b, a.Client, fmt.Sprintf("r%d-cold-%d", round, i), cold, agentapi.StartedCold))
			for _, del := range []string{id, fmt.Sprintf("r%d-cold-%d", round, i)} {
				if err := a.Client.DeleteVM(ctx, del); err != nil {
					b.Fatal(err)
				}
			}
		}
		setPool(b, a.Client, spec, 0)
		b.ReportMetric(pct(warm, 50), "warm-p50-ms")
		b.ReportMetric(pct(warm, 95), "warm-p95-ms")
		b.ReportMetric(pct(coldPut, 50), "cold-p50-ms")
		b.ReportMetric(pct(coldPut, 95), "cold-p95-ms")
	}
}
