package agent_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// migAgent is one agent of a migration test on the sim driver, behind a
// server that can refuse commits (blockCommit) as an unreachable target.
type migAgent struct {
	dir         string
	driver      *sim.Driver
	agent       *agent.Agent
	srv         *httptest.Server
	client      *agentapi.Client
	blockCommit atomic.Bool
	handler     atomic.Pointer[http.Handler]
}

func startMigAgent(t *testing.T, d *sim.Driver) *migAgent {
	t.Helper()
	m := &migAgent{dir: t.TempDir(), driver: d}
	m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if m.blockCommit.Load() && strings.HasSuffix(r.URL.Path, "/incoming/commit") {
			http.Error(w, `{"error":{"code":"unavailable","message":"test: commit blocked"}}`, http.StatusServiceUnavailable)
			return
		}
		(*m.handler.Load()).ServeHTTP(w, r)
	}))
	m.restart(t)
	m.client = agentapi.NewClient(m.srv.URL, token, agentapi.WithRetries(0))
	t.Cleanup(func() {
		m.srv.Close()
		_ = m.agent.Close()
	})
	return m
}

// restart closes the agent (its VMs, sim ones in the driver, go on) and
// starts a new one on the same state directory behind the same address.
func (m *migAgent) restart(t *testing.T) {
	t.Helper()
	if m.agent != nil {
		_ = m.agent.Close()
	}
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: m.dir, Driver: m.driver, Token: token,
		Capacity: agentapi.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 1 << 20},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	m.agent = a
	h := a.Handler()
	m.handler.Store(&h)
}

func (m *migAgent) ref() agentapi.PeerRef {
	return agentapi.PeerRef{Address: m.srv.URL, PublicKey: agentapi.EncodeKey(m.agent.PublicKey())}
}

func migSpec() agentapi.VMSpec {
	return agentapi.VMSpec{Image: sim.BuiltinImage, VCPUs: 1, MemoryMiB: 256, DiskMiB: 1,
		NICs: []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:12:34:56",
			PortForwards: []agentapi.PortForward{{GuestPort: 80}}}},
		Seed: &agentapi.SeedSpec{InstanceID: "m1", Hostname: "m1", UserData: "#!/bin/sh\necho hi\n"}}
}

// waitMigration polls the source until the migration of id is no longer
// running (bounded).
func waitMigration(t *testing.T, c *agentapi.Client, id string) agentapi.Migration {
	t.Helper()
	ctx := context.Background()
	for range 400 {
		mig, err := c.Migration(ctx, id)
		if err != nil {
			t.Fatalf("migration of %s: %v", id, err)
		}
		if mig.State != agentapi.MigrationRunning {
			return mig
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("migration of %s still running after 400 polls", id)
	return agentapi.Migration{}
}

func TestMigrateLiveSim(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	vm, err := src.client.CreateVM(ctx, "m1", spec)
	if err != nil {
		t.Fatal(err)
	}
	srcPort := vm.NICs[0].PortForwards[0].HostPort
	in := agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}
	got, err := dst.client.PutIncoming(ctx, "m1", in)
	if err != nil || got.State != agentapi.StateIncoming {
		t.Fatalf("put incoming: %+v, %v; want state incoming", got, err)
	}
	if again, err := dst.client.PutIncoming(ctx, "m1", in); err != nil || again.State != agentapi.StateIncoming {
		t.Fatalf("put incoming again: %+v, %v; want the same incoming vm", again, err)
	}
	// Nothing but a migration changes an incoming VM.
	if _, err := dst.client.Action(ctx, "m1", agentapi.ActionStart); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("start of an incoming vm: %v; want a conflict", err)
	}
	mig, err := src.client.Migrate(ctx, "m1", agentapi.MigrateSpec{Target: dst.ref(), Live: true})
	if err != nil || mig.State != agentapi.MigrationRunning || !mig.Live {
		t.Fatalf("migrate: %+v, %v", mig, err)
	}
	mig = waitMigration(t, src.client, "m1")
	if mig.State != agentapi.MigrationCompleted || mig.Phase != agentapi.PhaseDone {
		t.Fatalf("migration ended %s/%s (%s); want completed/done", mig.State, mig.Phase, mig.Error)
	}
	if mig.DowntimeMS <= 0 || mig.TotalMS < mig.DowntimeMS || mig.Memory.Total != 256<<20 || mig.Memory.Transferred != mig.Memory.Total {
		t.Errorf("figures %+v: want a downtime, a total at least that, all 256 MiB transferred", mig)
	}
	s, err := src.client.GetVM(ctx, "m1")
	if err != nil || s.State != agentapi.StateMigrated {
		t.Fatalf("source vm after the migration: %+v, %v; want migrated", s, err)
	}
	if _, err := src.client.Action(ctx, "m1", agentapi.ActionStart); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("start of a migrated vm on its source: %v; want a conflict (it must never run again)", err)
	}
	d, err := dst.client.GetVM(ctx, "m1")
	if err != nil || d.State != agentapi.StateRunning {
		t.Fatalf("target vm: %+v, %v; want running", d, err)
	}
	if d.NICs[0].MACAddress != vm.NICs[0].MACAddress || d.NICs[0].PortForwards[0].HostPort == 0 || d.NICs[0].PortForwards[0].GuestPort != 80 {
		t.Errorf("target nics %+v: want the same MAC and a host port of its own for guest port 80 (source had %d)", d.NICs, srcPort)
	}
	// Settled: a second migrate returns the completed one, a cancel is refused.
	if again, err := src.client.Migrate(ctx, "m1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil || again.State != agentapi.MigrationCompleted {
		t.Errorf("migrate again: %+v, %v; want the completed migration", again, err)
	}
	if err := src.client.CancelMigration(ctx, "m1"); !errors.Is(err, agentapi.ErrConflict) {
		t.Errorf("cancel of a completed migration: %v; want a conflict", err)
	}
	// Both agents restarted: the same truth.
	src.restart(t)
	dst.restart(t)
	if s, _ := src.client.GetVM(ctx, "m1"); s.State != agentapi.StateMigrated {
		t.Errorf("source after restart: %s; want migrated", s.State)
	}
	if d, _ := dst.client.GetVM(ctx, "m1"); d.State != agentapi.StateRunning {
		t.Errorf("target after restart: %s; want running", d.State)
	}
	if err := src.client.DeleteVM(ctx, "m1"); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migration(ctx, "m1"); !errors.Is(err, agentapi.ErrNotFound) {
		t.Errorf("migration after the source's copy is deleted: %v; want not found", err)
	}
}

func TestMigrateColdSim(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	spec.Stopped = true
	if _, err := src.client.CreateVM(ctx, "c1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "c1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("live incoming of a stopped vm: %v; want a conflict", err)
	}
	if _, err := dst.client.PutIncoming(ctx, "c1", agentapi.IncomingSpec{Spec: spec, Source: src.ref()}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, "c1", agentapi.MigrateSpec{Target: dst.ref()}); err != nil {
		t.Fatal(err)
	}
	mig := waitMigration(t, src.client, "c1")
	if mig.State != agentapi.MigrationCompleted || mig.Live {
		t.Fatalf("cold migration: %+v; want completed, not live", mig)
	}
	if d, err := dst.client.GetVM(ctx, "c1"); err != nil || d.State != agentapi.StateStopped {
		t.Fatalf("target vm: %+v, %v; want stopped", d, err)
	}
	// Its seed came along: the target's guest status reads it once started.
	if d, err := dst.client.Action(ctx, "c1", agentapi.ActionStart); err != nil || d.State != agentapi.StateRunning {
		t.Fatalf("start on the target: %+v, %v", d, err)
	}
	if g, err := dst.client.Guest(ctx, "c1"); err != nil || g.Hostname != "m1" {
		t.Errorf("guest on the target: %+v, %v; want hostname m1 from the moved seed", g, err)
	}
}

func TestMigrateCancelSim(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{MigrationTime: time.Minute, MigrationSteps: 600}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "x1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "x1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, "x1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	for range 200 { // until pre-copy moved something
		mig, _ := src.client.Migration(ctx, "x1")
		if mig.Memory.Transferred > 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := src.client.CancelMigration(ctx, "x1"); err != nil {
		t.Fatal(err)
	}
	mig, err := src.client.Migration(ctx, "x1")
	if err != nil || mig.State != agentapi.MigrationCancelled {
		t.Fatalf("migration after cancel: %+v, %v; want cancelled", mig, err)
	}
	if s, _ := src.client.GetVM(ctx, "x1"); s.State != agentapi.StateRunning {
		t.Fatalf("source vm after cancel: %s; want running", s.State)
	}
	var d agentapi.VM
	for range 100 {
		if d, err = dst.client.GetVM(ctx, "x1"); err == nil && d.State == agentapi.StateFailed {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if d.State != agentapi.StateFailed || d.Reason == "" {
		t.Fatalf("target after cancel: %+v; want failed with a reason", d)
	}
	if _, err := dst.client.CommitIncoming(ctx, "x1"); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("commit of a failed incoming vm: %v; want a conflict", err)
	}
	if err := dst.client.DeleteVM(ctx, "x1"); err != nil {
		t.Fatal(err)
	}
	// The source may migrate again later.
	if _, err := dst.client.PutIncoming(ctx, "x1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatalf("prepare again: %v", err)
	}
}

func TestMigrationStreamOnlyFromTheNamedSource(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	other := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	for _, a := range []*migAgent{src, other} {
		if _, err := a.client.CreateVM(ctx, "s1", spec); err != nil {
			t.Fatal(err)
		}
	}
	// The target expects the VM from other; src streams it.
	if _, err := dst.client.PutIncoming(ctx, "s1", agentapi.IncomingSpec{Spec: spec, Source: other.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, "s1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	mig := waitMigration(t, src.client, "s1")
	if mig.State != agentapi.MigrationFailed || !strings.Contains(mig.Error, "refused this agent's identity") {
		t.Fatalf("migration from an agent the target does not expect: %+v; want failed, refused identity", mig)
	}
	if s, _ := src.client.GetVM(ctx, "s1"); s.State != agentapi.StateRunning {
		t.Errorf("source vm: %s; want running", s.State)
	}
	if d, _ := dst.client.GetVM(ctx, "s1"); d.State != agentapi.StateIncoming {
		t.Errorf("target vm: %s; want still incoming (nothing arrived)", d.State)
	}
	// A target whose pinned key is wrong gets nothing either.
	bad := dst.ref()
	bad.PublicKey = other.ref().PublicKey
	if _, err := src.client.Migrate(ctx, "s1", agentapi.MigrateSpec{Target: bad, Live: true}); err != nil {
		t.Fatal(err)
	}
	if mig := waitMigration(t, src.client, "s1"); mig.State != agentapi.MigrationFailed || !strings.Contains(mig.Error, "did not prove") {
		t.Fatalf("migration to an agent with another key: %+v; want failed, identity not proven", mig)
	}
}

func TestMigrateRefusals(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "r1", spec); err != nil {
		t.Fatal(err)
	}
	reason := func(err error) string {
		var ae *agentapi.Error
		if errors.As(err, &ae) && ae.Status == http.StatusConflict {
			return ae.Message
		}
		return "not a conflict: " + errString(err)
	}
	if _, err := src.client.Migrate(ctx, "r1", agentapi.MigrateSpec{Target: src.ref(), Live: true}); !strings.Contains(reason(err), "itself") {
		t.Errorf("migrate to its own agent: %v", err)
	}
	if _, err := src.client.Migrate(ctx, "r1", agentapi.MigrateSpec{Target: dst.ref()}); !strings.Contains(reason(err), "migrate it live") {
		t.Errorf("cold migrate of a running vm: %v", err)
	}
	fork := spec
	fork.Snapshot = &agentapi.SnapshotSource{ID: "snap"}
	if _, err := dst.client.PutIncoming(ctx, "r2", agentapi.IncomingSpec{Spec: fork, Source: src.ref(), Live: true}); !strings.Contains(reason(err), "fork child") {
		t.Errorf("incoming fork child: %v", err)
	}
	vol := spec
	vol.Volumes = []agentapi.VolumeAttachment{{ID: "v1", ReadOnly: true}}
	if _, err := dst.client.PutIncoming(ctx, "r3", agentapi.IncomingSpec{Spec: vol, Source: src.ref(), Live: true}); !strings.Contains(reason(err), "read-only") {
		t.Errorf("incoming vm with a read-only volume (which other vms may share): %v", err)
	}
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

// TestMigrateSourceRestartBeforeCommit: the stream completed but the target
// could not be told to run the VM, and the source agent restarted: the new
// agent reports it migrated and commits the target itself.
func TestMigrateSourceRestartBeforeCommit(t *testing.T) {
	old := agent.CommitTimeout
	agent.CommitTimeout = 300 * time.Millisecond
	t.Cleanup(func() { agent.CommitTimeout = old })
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "k1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "k1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	dst.blockCommit.Store(true)
	if _, err := src.client.Migrate(ctx, "k1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	for range 200 {
		if s, _ := src.client.GetVM(ctx, "k1"); s.State == agentapi.StateMigrated {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if d, _ := dst.client.GetVM(ctx, "k1"); d.State != agentapi.StateIncoming {
		t.Fatalf("target before the commit: %s; want incoming (paused, never run)", d.State)
	}
	src.restart(t)
	if s, _ := src.client.GetVM(ctx, "k1"); s.State != agentapi.StateMigrated {
		t.Fatalf("source after restart: %s; want migrated", s.State)
	}
	dst.blockCommit.Store(false)
	var d agentapi.VM
	for range 200 {
		if d, _ = dst.client.GetVM(ctx, "k1"); d.State == agentapi.StateRunning {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if d.State != agentapi.StateRunning {
		t.Fatalf("target after the restarted source committed it: %s; want running", d.State)
	}
	if mig := waitMigration(t, src.client, "k1"); mig.State != agentapi.MigrationCompleted {
		t.Fatalf("migration: %+v; want completed", mig)
	}
}

// TestMigrateRollBackWhenTargetLost: the stream completed, the target's
// copy was lost before its commit (deleted there): cancelling on the source
// runs the VM there again; one copy runs.
func TestMigrateRollBackWhenTargetLost(t *testing.T) {
	old := agent.CommitTimeout
	agent.CommitTimeout = 200 * time.Millisecond
	t.Cleanup(func() { agent.CommitTimeout = old })
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "l1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "l1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	dst.blockCommit.Store(true)
	if _, err := src.client.Migrate(ctx, "l1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	for range 200 {
		if s, _ := src.client.GetVM(ctx, "l1"); s.State == agentapi.StateMigrated {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	// While the target holds a copy, the source refuses to run its own.
	time.Sleep(300 * time.Millisecond)
	if err := src.client.CancelMigration(ctx, "l1"); !errors.Is(err, agentapi.ErrConflict) {
		t.Fatalf("cancel while the target holds the stream: %v; want a conflict", err)
	}
	if err := dst.client.DeleteVM(ctx, "l1"); err != nil {
		t.Fatal(err)
	}
	if err := src.client.CancelMigration(ctx, "l1"); err != nil {
		t.Fatalf("cancel once the target's copy is gone: %v", err)
	}
	if s, _ := src.client.GetVM(ctx, "l1"); s.State != agentapi.StateRunning {
		t.Fatalf("source after the roll back: %s; want running", s.State)
	}
	if mig, _ := src.client.Migration(ctx, "l1"); mig.State != agentapi.MigrationFailed || !strings.Contains(mig.Error, "rolled back") {
		t.Fatalf("migration after the roll back: %+v", mig)
	}
}

// TestMigrateTargetRestartAfterPrepare: the target agent restarts between
// the prepare and the migration: the incoming VM is still there, waiting,
// and the migration completes.
func TestMigrateTargetRestartAfterPrepare(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "p1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "p1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	dst.restart(t)
	if d, err := dst.client.GetVM(ctx, "p1"); err != nil || d.State != agentapi.StateIncoming {
		t.Fatalf("target after restart: %+v, %v; want incoming", d, err)
	}
	if _, err := src.client.Migrate(ctx, "p1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if mig := waitMigration(t, src.client, "p1"); mig.State != agentapi.MigrationCompleted {
		t.Fatalf("migration: %+v; want completed", mig)
	}
	if d, _ := dst.client.GetVM(ctx, "p1"); d.State != agentapi.StateRunning {
		t.Fatalf("target: %s; want running", d.State)
	}
}

// TestMigratePausedVMStaysPaused: a VM paused on the source is paused on
// the target after a live migration, and a resume runs it there.
func TestMigratePausedVMStaysPaused(t *testing.T) {
	ctx := context.Background()
	src := startMigAgent(t, sim.New(sim.Options{}))
	dst := startMigAgent(t, sim.New(sim.Options{}))
	spec := migSpec()
	if _, err := src.client.CreateVM(ctx, "z1", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Action(ctx, "z1", agentapi.ActionPause); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.PutIncoming(ctx, "z1", agentapi.IncomingSpec{Spec: spec, Source: src.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.Migrate(ctx, "z1", agentapi.MigrateSpec{Target: dst.ref(), Live: true}); err != nil {
		t.Fatal(err)
	}
	if mig := waitMigration(t, src.client, "z1"); mig.State != agentapi.MigrationCompleted || !mig.SourcePaused {
		t.Fatalf("migration: %+v; want completed, source paused", mig)
	}
	if d, _ := dst.client.GetVM(ctx, "z1"); d.State != agentapi.StatePaused {
		t.Fatalf("target: %s; want paused", d.State)
	}
	if d, err := dst.client.Action(ctx, "z1", agentapi.ActionResume); err != nil || d.State != agentapi.StateRunning {
		t.Fatalf("resume on the target: %+v, %v", d, err)
	}
}
