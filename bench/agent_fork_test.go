package bench

// Fork steps with real guests (TCG here):
//
//	go test ./bench -run '^$' -bench AgentFork -benchtime 5x -timeout 30m
//
// They report numbers and never pass or fail on time.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// pauseLog keeps the paused_ms of the agent's "snapshot taken" log lines:
// how long the source's vCPUs were stopped, which only the agent sees.
type pauseLog struct {
	mu     sync.Mutex
	paused []time.Duration
}

func (p *pauseLog) Enabled(context.Context, slog.Level) bool { return true }
func (p *pauseLog) WithAttrs([]slog.Attr) slog.Handler       { return p }
func (p *pauseLog) WithGroup(string) slog.Handler            { return p }
func (p *pauseLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "snapshot taken" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "paused_ms" {
			p.mu.Lock()
			p.paused = append(p.paused, time.Duration(a.Value.Int64())*time.Millisecond)
			p.mu.Unlock()
		}
		return true
	})
	return nil
}

// startForkBenchAgent runs a qemu agent in process with real HTTP and kills
// its guests at the end. It returns a client of the agent and the agent's
// identity key, which a peer must be given to pull from it.
func startForkBenchAgent(b *testing.B, log slog.Handler) (*agentapi.Client, string) {
	dir := b.TempDir()
	ctx := context.Background()
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(b), Accel: testenv.Accel(), Logger: slog.New(log)})
	if err != nil {
		b.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: slog.New(log)})
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
	return agentapi.NewClient(srv.URL, "agent-token", agentapi.WithTimeout(time.Minute)), agentapi.EncodeKey(a.PublicKey())
}

// pullFiles streams every file of a snapshot into dir with the checks of an
// agent's pull (size, sha256; a RAM image in its sparse form; the sync comes
// later, in the background): the transfer on its own. It returns the bytes
// that crossed the wire.
func pullFiles(b *testing.B, c *agentapi.Client, snap agentapi.Snapshot, dir string) int64 {
	ctx := context.Background()
	var wire int64
	for _, f := range snap.Files {
		body, _, err := c.OpenSnapshotFile(ctx, snap.ID, f.Name)
		if err != nil {
			b.Fatal(err)
		}
		out, err := os.Create(filepath.Join(dir, f.Name))
		if err != nil {
			b.Fatal(err)
		}
		var n, sent int64
		var sum string
		want := f.SHA256
		if f.Kind == agentapi.SnapshotFileRAM {
			sum, sent, err = agent.ReadSparse(out, body, f.SizeBytes, agent.NewRAMHash)
			n, want = f.SizeBytes, f.BLAKE3
		} else {
			h := sha256.New()
			n, err = io.Copy(io.MultiWriter(out, h), body)
			sum, sent = hex.EncodeToString(h.Sum(nil)), n
		}
		wire += sent
		_ = body.Close()
		_ = out.Close()
		if err != nil || n != f.SizeBytes || sum != want {
			b.Fatalf("pull %s: %d bytes, %v", f.Name, n, err)
		}
	}
	return wire
}

// BenchmarkAgentFork forks a running 256 MiB guest once per iteration:
//   - snapshot-ms: PUT /v1/snapshots/{id} (pause, disk switch, device state
//     to a file, RAM copied out, continue, checksums, metadata);
//   - paused-ms: the part of it the source's vCPUs were stopped;
//   - restore-ms: PUT /v1/vms/{child} from it on the same agent, until the
//     answer (overlay, QEMU start with the state loaded, cont: running);
//   - transfer-ms: streaming the snapshot's files from the agent with the
//     checks of a pull (size, sha256), client side;
//   - remote-child-ms: PUT /v1/vms/{child} on a second agent: pull + restore;
//   - transfer-MB: the bytes of the snapshot's files on the wire (a RAM
//     image sends only its non-zero pages).
func BenchmarkAgentFork(b *testing.B) {
	defer machineState(b)()
	pauses := &pauseLog{}
	src, srcKey := startForkBenchAgent(b, pauses)
	far, _ := startForkBenchAgent(b, &pauseLog{})
	ctx := context.Background()
	info, err := src.Info(ctx)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("accel %s (%s)", info.Accel, info.AccelNote)
	spec := agentapi.VMSpec{Image: "busybox", VCPUs: 1, MemoryMiB: 256, DiskMiB: 64}
	if _, err := src.CreateVM(ctx, "src", spec); err != nil {
		b.Fatal(err)
	}
	// Fork a guest that runs its init loop, not one still booting.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, _ := src.Console(ctx, "src")
		if readyLine.MatchString(con) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("source not ready; console:\n%s", con)
		}
		time.Sleep(100 * time.Millisecond)
	}

	var snaps, restores, transfers, remotes []time.Duration
	var size int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id := fmt.Sprintf("fork-%d", i)
		t0 := time.Now()
		snap, err := src.CreateSnapshot(ctx, id, agentapi.SnapshotSpec{VMID: "src"})
		if err != nil {
			b.Fatal(err)
		}
		snaps = append(snaps, time.Since(t0))

		child := spec
		child.Snapshot = &agentapi.SnapshotSource{ID: id}
		t0 = time.Now()
		if vm, err := src.CreateVM(ctx, id+"-local", child); err != nil || vm.State != agentapi.StateRunning {
			b.Fatalf("local child: %+v, %v", vm, err)
		}
		restores = append(restores, time.Since(t0))

		tmp := b.TempDir()
		t0 = time.Now()
		size = pullFiles(b, src, snap, tmp)
		transfers = append(transfers, time.Since(t0))

		child.Snapshot.Address, child.Snapshot.PublicKey = src.BaseURL(), srcKey
		t0 = time.Now()
		if vm, err := far.CreateVM(ctx, id+"-far", child); err != nil || vm.State != agentapi.StateRunning {
			b.Fatalf("remote child: %+v, %v", vm, err)
		}
		remotes = append(remotes, time.Since(t0))

		b.StopTimer()
		for _, c := range []struct {
			client *agentapi.Client
			vm     string
		}{{src, id + "-local"}, {far, id + "-far"}} {
			if err := c.client.DeleteVM(ctx, c.vm); err != nil {
				b.Fatal(err)
			}
			if err := c.client.DeleteSnapshot(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
		_ = os.RemoveAll(tmp)
		b.StartTimer()
	}
	b.ReportMetric(p50(snaps), "snapshot-p50-ms")
	pauses.mu.Lock()
	if len(pauses.paused) > 0 {
		b.ReportMetric(p50(pauses.paused), "paused-p50-ms")
	}
	pauses.mu.Unlock()
	b.ReportMetric(p50(restores), "restore-p50-ms")
	b.ReportMetric(p50(transfers), "transfer-p50-ms")
	b.ReportMetric(p50(remotes), "remote-child-p50-ms")
	b.ReportMetric(float64(size)/(1<<20), "transfer-MB")
}
