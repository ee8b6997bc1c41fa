package bench

// A fork through the control API with real guests (TCG here):
//
//	go test ./bench -run '^$' -bench ForkControl -benchtime 5x -timeout 30m
//
// It reports numbers and never passes or fails on time.

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// forkClock records when each step of a fork pass was reached.
type forkClock struct {
	mu    sync.Mutex
	steps map[string]time.Time // step or step/slot -> when
}

func (c *forkClock) hook(_ context.Context, _ string, step string, slot int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := step
	if slot >= 0 {
		key += "/" + string(rune('0'+slot))
	}
	c.steps[key] = time.Now()
	return nil
}

func (c *forkClock) reset() {
	c.mu.Lock()
	c.steps = map[string]time.Time{}
	c.mu.Unlock()
}

func (c *forkClock) at(key string) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.steps[key]
}

// BenchmarkForkControl forks a running 256 MiB guest into 4 children with
// POST /v1/forks (colocate; the source host has room for 2 children, so 2
// spill to a second host, which pulls the snapshot), once per iteration:
//   - fork-ms: the whole request, client side (the figure of the goal);
//   - snapshot-ms: the agent's snapshot call (pause, memory to a file,
//     continue, checksums);
//   - restore-ms: the agent call that starts a child on the source host
//     (overlay, QEMU with the state loaded, running), p50 over those children;
//   - remote-child-ms: the same on the other host: pull + checksum + restore;
//   - transfer-ms: remote-child-ms - restore-ms, the pull's share;
//   - overhead-ms: fork-ms - snapshot-ms - the children's wall time (the
//     children start 4 at a time): HTTP, database writes, placement.
func BenchmarkForkControl(b *testing.B) {
	defer machineState(b)()
	clock := &forkClock{steps: map[string]time.Time{}}
	c := testenv.StartControl(b, testenv.ControlOptions{Hooks: &control.Hooks{ForkStep: clock.hook}})
	agents := map[string]*testenv.Agent{
		// room for the source and two children of 1 vCPU, 256 MiB
		"h1": testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu", VCPUs: 3, MemoryMiB: 1024, DiskMiB: 8192}),
		"h2": testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu", VCPUs: 8, MemoryMiB: 4096, DiskMiB: 8192}),
	}
	for name, a := range agents {
		c.RegisterHost(b, name, a.Address)
	}
	ctx := context.Background()
	src, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "src", Image: "busybox", VCPUs: 1, MemoryMiB: 256, DiskMiB: 64, Host: "h1"}, "")
	if err != nil {
		b.Fatal(err)
	}
	// Fork a guest that runs its init loop, not one still booting.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, _ := agents["h1"].Client.Console(ctx, src.ID)
		if readyLine.MatchString(con) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("source not ready; console:\n%s", con)
		}
		time.Sleep(100 * time.Millisecond)
	}

	var totals, snaps, restores, remotes, transfers, overheads []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		clock.reset()
		t0 := time.Now()
		f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 4, Placement: api.PlacementColocate}, "")
		total := time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		var hosts []string
		for _, ch := range f.Children {
			hosts = append(hosts, ch.Host)
		}
		if f.Phase != api.ForkReady || !slices.Equal(hosts, []string{"h1", "h1", "h2", "h2"}) {
			b.Fatalf("fork %s: phase %s, children on %v; want ready, 2 on h1 and 2 on h2", f.ID, f.Phase, hosts)
		}
		totals = append(totals, total)
		snap := clock.at(control.ForkStepSnapshotTaken).Sub(clock.at(control.ForkStepSnapshotStart))
		snaps = append(snaps, snap)
		var first, last time.Time
		var local, remote []time.Duration
		for slot, ch := range f.Children {
			key := "/" + string(rune('0'+slot))
			start, done := clock.at(control.ForkStepChildStart+key), clock.at(control.ForkStepChildStarted+key)
			if first.IsZero() || start.Before(first) {
				first = start
			}
			if done.After(last) {
				last = done
			}
			if ch.Host == "h1" {
				local = append(local, done.Sub(start))
			} else {
				remote = append(remote, done.Sub(start))
			}
		}
		r, rr := median(local), median(remote)
		restores = append(restores, r)
		remotes = append(remotes, rr)
		transfers = append(transfers, rr-r)
		overheads = append(overheads, total-snap-last.Sub(first))
		if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(p50(totals), "fork-p50-ms")
	b.ReportMetric(p50(snaps), "snapshot-p50-ms")
	b.ReportMetric(p50(restores), "restore-p50-ms")
	b.ReportMetric(p50(remotes), "remote-child-p50-ms")
	b.ReportMetric(p50(transfers), "transfer-p50-ms")
	b.ReportMetric(p50(overheads), "overhead-p50-ms")
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
