package bench

// Live migration between two agents with real guests (TCG here):
//
//	go test ./bench -run '^$' -bench LiveMigration -benchtime 1x -timeout 60m
//
// A busybox guest that prints a counter every 100 ms (and, "dirty", rewrites
// 48 MiB of a tmpfs file with random bytes in a loop) is migrated back and
// forth between two in-process agents five times; the figures are the p50
// of the five as the source agent reported them: downtime_ms (the guest
// paused: QEMU's downtime plus the commit until the target runs it),
// vmm_downtime_ms (QEMU's own), total_ms, setup_ms, against QEMU's default
// downtime limit of 300 ms. It reports numbers and never passes or fails on
// time.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const (
	migCounter = "#!/bin/sh\ni=0\nwhile :; do i=$((i+1)); echo \"kvm-count $i\"; usleep 100000; done\n"
	migDirty   = "#!/bin/sh\nmkdir -p /tmp/d\n(while :; do dd if=/dev/urandom of=/tmp/d/f bs=1M count=48 2>/dev/null; done) &\n" +
		"i=0\nwhile :; do i=$((i+1)); echo \"kvm-count $i\"; usleep 100000; done\n"
	migRuns = 5
)

type migBenchAgent struct {
	client *agentapi.Client
	ref    agentapi.PeerRef
}

func startMigBenchAgent(b *testing.B) migBenchAgent {
	dir := b.TempDir()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_BENCH_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(b), Accel: testenv.Accel(), Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(a.Handler())
	b.Cleanup(func() {
		srv.Close()
		_ = a.Close()
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return migBenchAgent{client: agentapi.NewClient(srv.URL, "agent-token", agentapi.WithTimeout(time.Minute)),
		ref: agentapi.PeerRef{Address: srv.URL, PublicKey: agentapi.EncodeKey(a.PublicKey())}}
}

func BenchmarkLiveMigration(b *testing.B) {
	defer machineState(b)()
	for _, mem := range []int64{256, 1024} {
		for _, load := range []string{"idle", "dirty"} {
			b.Run(fmt.Sprintf("mem=%dMiB/%s", mem, load), func(b *testing.B) {
				script := migCounter
				if load == "dirty" {
					script = migDirty
				}
				for range b.N {
					benchMigrations(b, mem, script)
				}
			})
		}
	}
}

func benchMigrations(b *testing.B, memMiB int64, script string) {
	ctx := context.Background()
	cur, other := startMigBenchAgent(b), startMigBenchAgent(b)
	const id = "mig"
	spec := agentapi.VMSpec{Image: "busybox", VCPUs: 1, MemoryMiB: memMiB, DiskMiB: 64,
		Seed: &agentapi.SeedSpec{InstanceID: id, Hostname: id, UserData: script}}
	if _, err := cur.client.CreateVM(ctx, id, spec); err != nil {
		b.Fatal(err)
	}
	waitConsoleText(b, cur.client, id, "kvm-count 30")
	var down, vmmDown, total, setup []time.Duration
	var failed int
	for run := range migRuns {
		if _, err := other.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: cur.ref, Live: true}); err != nil {
			b.Fatal(err)
		}
		if _, err := cur.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: other.ref, Live: true}); err != nil {
			b.Fatal(err)
		}
		var mig agentapi.Migration
		deadline := time.Now().Add(10 * time.Minute)
		for {
			var err error
			if mig, err = cur.client.Migration(ctx, id); err != nil {
				b.Fatal(err)
			}
			if mig.State != agentapi.MigrationRunning || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if mig.State != agentapi.MigrationCompleted {
			b.Fatalf("run %d: migration %+v", run, mig)
		}
		b.Logf("run %d: downtime %d ms (qemu %d), total %d ms, setup %d ms, throttle %d%%, memory %+v",
			run, mig.DowntimeMS, mig.VMMDowntimeMS, mig.TotalMS, mig.SetupMS, mig.Throttle, mig.Memory)
		down = append(down, time.Duration(mig.DowntimeMS)*time.Millisecond)
		vmmDown = append(vmmDown, time.Duration(mig.VMMDowntimeMS)*time.Millisecond)
		total = append(total, time.Duration(mig.TotalMS)*time.Millisecond)
		setup = append(setup, time.Duration(mig.SetupMS)*time.Millisecond)
		if err := cur.client.DeleteVM(ctx, id); err != nil {
			b.Fatal(err)
		}
		cur, other = other, cur
		// The guest keeps counting on its new host.
		con, err := cur.client.ConsoleTail(ctx, id, 4096)
		if err != nil || strings.Contains(con, "kvm-guest-ready") {
			failed++
		}
	}
	b.ReportMetric(p50(down), "downtime_ms")
	b.ReportMetric(p50(vmmDown), "vmm_downtime_ms")
	b.ReportMetric(p50(total), "total_ms")
	b.ReportMetric(p50(setup), "setup_ms")
	b.ReportMetric(float64(slices.Max(down).Milliseconds()), "max_downtime_ms")
	b.ReportMetric(float64(failed), "reboots")
}

func waitConsoleText(b *testing.B, c *agentapi.Client, id, text string) {
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		if con, err := c.ConsoleTail(context.Background(), id, 1<<20); err == nil && strings.Contains(con, text) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	b.Fatalf("vm %s: %q not on its console within 3 minutes", id, text)
}
