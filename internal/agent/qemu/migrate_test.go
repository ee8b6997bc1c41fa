package qemu_test

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// counterScript prints an incrementing counter every 100 ms on the console.
const counterScript = "#!/bin/sh\ni=0\nwhile :; do i=$((i+1)); echo \"kvm-count $i\"; usleep 100000; done\n"

// dirtyScript is counterScript while a loop rewrites 48 MiB of a tmpfs file
// (guest memory) with random bytes, as fast as the guest can.
const dirtyScript = "#!/bin/sh\nmkdir -p /tmp/d\n(while :; do dd if=/dev/urandom of=/tmp/d/f bs=1M count=48 2>/dev/null; done) &\n" +
	"i=0\nwhile :; do i=$((i+1)); echo \"kvm-count $i\"; usleep 100000; done\n"

var countLine = regexp.MustCompile(`(?m)^kvm-count ([0-9]+)\r?$`)

func counts(con string) []int {
	var out []int
	for _, m := range countLine.FindAllStringSubmatch(con, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

func peerRef(f *forkAgent) agentapi.PeerRef {
	return agentapi.PeerRef{Address: f.srv.URL, PublicKey: agentapi.EncodeKey(f.ag.PublicKey())}
}

func migGuest(id, script string, memMiB int64) agentapi.VMSpec {
	spec := guest
	spec.MemoryMiB = memMiB
	spec.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:60:00:01",
		PortForwards: []agentapi.PortForward{{GuestPort: 80}}}}
	spec.Seed = &agentapi.SeedSpec{InstanceID: id, Hostname: id, UserData: script}
	return spec
}

// waitCount waits until vm id's console on f shows kvm-count n or more.
func waitCount(t *testing.T, f *forkAgent, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		cs := counts(f.console(t, id))
		if len(cs) > 0 && cs[len(cs)-1] >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: no kvm-count %d within %s; console:\n%s", id, n, bootWait, f.console(t, id))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// liveMigrate prepares id on dst, migrates it from src and waits for the end.
func liveMigrate(t *testing.T, src, dst *forkAgent, id string, spec agentapi.VMSpec, ms agentapi.MigrateSpec) agentapi.Migration {
	t.Helper()
	ctx := context.Background()
	if _, err := dst.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: peerRef(src), Live: true}); err != nil {
		t.Fatalf("prepare %s on the target: %v", id, err)
	}
	ms.Target, ms.Live = peerRef(dst), true
	if _, err := src.client.Migrate(ctx, id, ms); err != nil {
		t.Fatalf("migrate %s: %v", id, err)
	}
	return waitMigrated(t, src, id)
}

func waitMigrated(t *testing.T, src *forkAgent, id string) agentapi.Migration {
	t.Helper()
	deadline := time.Now().Add(bootWait)
	for {
		mig, err := src.client.Migration(context.Background(), id)
		if err != nil {
			t.Fatalf("migration of %s: %v", id, err)
		}
		if mig.State != agentapi.MigrationRunning {
			return mig
		}
		if time.Now().After(deadline) {
			t.Fatalf("migration of %s still running after %s: %+v", id, bootWait, mig)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// tail records when each counter value first appeared on either console.
type countTail struct {
	mu   sync.Mutex
	seen map[int]time.Time
	stop chan struct{}
	done chan struct{}
}

func startTail(t *testing.T, id string, agents ...*forkAgent) *countTail {
	tl := &countTail{seen: map[int]time.Time{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(tl.done)
		for {
			select {
			case <-tl.stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			now := time.Now()
			for _, f := range agents {
				for _, n := range counts(f.console(t, id)) {
					tl.mu.Lock()
					if _, ok := tl.seen[n]; !ok {
						tl.seen[n] = now
					}
					tl.mu.Unlock()
				}
			}
		}
	}()
	return tl
}

// maxGap is the longest time between two consecutive counter values.
func (tl *countTail) maxGap() (time.Duration, int) {
	close(tl.stop)
	<-tl.done
	var gap time.Duration
	at := 0
	for n, ts := range tl.seen {
		if prev, ok := tl.seen[n-1]; ok && ts.Sub(prev) > gap {
			gap, at = ts.Sub(prev), n
		}
	}
	return gap, at
}

func TestLiveMigrationKeepsCounting(t *testing.T) {
	ctx := context.Background()
	src := startForkAgent(t, t.TempDir())
	dst := startForkAgent(t, t.TempDir())
	const id = "mig"
	spec := migGuest(id, counterScript, 128)
	vm, err := src.client.CreateVM(ctx, id, spec)
	if err != nil {
		t.Fatal(err)
	}
	waitCount(t, src, id, 20)
	srcURL := fmt.Sprintf("http://127.0.0.1:%d/", vm.NICs[0].PortForwards[0].HostPort)
	if body := get(t, srcURL, bootWait); !strings.Contains(body, "kvm-guest "+id) {
		t.Fatalf("source page %q", body)
	}
	tl := startTail(t, id, src, dst)
	mig := liveMigrate(t, src, dst, id, spec, agentapi.MigrateSpec{})
	if mig.State != agentapi.MigrationCompleted {
		t.Fatalf("migration: %+v; want completed", mig)
	}
	t.Logf("migration: downtime %d ms (qemu %d ms), total %d ms, setup %d ms, memory %+v, disk %+v",
		mig.DowntimeMS, mig.VMMDowntimeMS, mig.TotalMS, mig.SetupMS, mig.Memory, mig.Disk)
	last := counts(src.console(t, id))
	waitCount(t, dst, id, last[len(last)-1]+20)
	gap, at := tl.maxGap()
	t.Logf("longest gap between counter values seen: %s (before kvm-count %d)", gap, at)

	s, err := src.client.GetVM(ctx, id)
	if err != nil || s.State != agentapi.StateMigrated {
		t.Fatalf("source vm %+v, %v; want migrated", s, err)
	}
	d, err := dst.client.GetVM(ctx, id)
	if err != nil || d.State != agentapi.StateRunning {
		t.Fatalf("target vm %+v, %v; want running", d, err)
	}
	dcon := dst.console(t, id)
	if strings.Contains(dcon, "kvm-guest-ready") {
		t.Fatalf("the guest booted again on the target:\n%s", dcon)
	}
	// One counter, continued: the target's first value follows the
	// source's last (a line cut at the switch may be split between them).
	sc, dc := counts(src.console(t, id)), counts(dcon)
	if len(dc) == 0 || dc[0] < 2 || dc[0] > sc[len(sc)-1]+2 {
		t.Fatalf("counter on the target starts at %v, the source ended at %d: want the next value", dc[:min(3, len(dc))], sc[len(sc)-1])
	}
	for i := 1; i < len(dc); i++ {
		if dc[i] != dc[i-1]+1 {
			t.Fatalf("counter on the target jumps from %d to %d", dc[i-1], dc[i])
		}
	}
	// Polling (20 ms) and TCG scheduling on a shared host add to the pause
	// the agent reports; 2 s of margin, relative to what it reported.
	if limit := time.Duration(mig.DowntimeMS)*time.Millisecond + 2*time.Second; gap > limit {
		t.Errorf("the counter stopped for %s, more than the reported downtime %d ms + 2 s", gap, mig.DowntimeMS)
	}
	// HTTP through the target's own forward.
	f := d.NICs[0].PortForwards[0]
	if f.HostPort == 0 || f.GuestPort != 80 || d.NICs[0].MACAddress != vm.NICs[0].MACAddress {
		t.Fatalf("target nic %+v", d.NICs[0])
	}
	if body := get(t, fmt.Sprintf("http://127.0.0.1:%d/", f.HostPort), time.Minute); !strings.Contains(body, "kvm-guest "+id) {
		t.Fatalf("target page %q", body)
	}
	if err := src.client.DeleteVM(ctx, id); err != nil {
		t.Fatal(err)
	}
	waitCount(t, dst, id, dc[len(dc)-1]+5)
}

func TestLiveMigrationCancelKeepsSourceRunning(t *testing.T) {
	ctx := context.Background()
	src := startForkAgent(t, t.TempDir())
	dst := startForkAgent(t, t.TempDir())
	const id = "cxl"
	spec := migGuest(id, dirtyScript, 256)
	if _, err := src.client.CreateVM(ctx, id, spec); err != nil {
		t.Fatal(err)
	}
	waitCount(t, src, id, 20)
	if _, err := dst.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: peerRef(src), Live: true}); err != nil {
		t.Fatal(err)
	}
	// A 1 ms downtime limit: pre-copy goes on until cancelled.
	if _, err := src.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: peerRef(dst), Live: true, MaxDowntimeMS: 1}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(bootWait)
	for {
		mig, err := src.client.Migration(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if mig.State != agentapi.MigrationRunning {
			t.Fatalf("migration ended before the cancel: %+v", mig)
		}
		if mig.Phase == agentapi.PhaseMemory && mig.Memory.Transferred > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pre-copy within %s: %+v", bootWait, mig)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := src.client.CancelMigration(ctx, id); err != nil {
		t.Fatal(err)
	}
	mig, err := src.client.Migration(ctx, id)
	if err != nil || mig.State != agentapi.MigrationCancelled {
		t.Fatalf("after cancel: %+v, %v", mig, err)
	}
	s, err := src.client.GetVM(ctx, id)
	if err != nil || s.State != agentapi.StateRunning {
		t.Fatalf("source after cancel: %+v, %v; want running", s, err)
	}
	cs := counts(src.console(t, id))
	waitCount(t, src, id, cs[len(cs)-1]+10)
	for {
		d, err := dst.client.GetVM(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if d.State == agentapi.StateFailed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("target after cancel: %+v; want failed", d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if pids := processesOf2(dst, id); len(pids) != 0 {
		t.Fatalf("the failed target still has qemu %v", pids)
	}
}

func processesOf2(f *forkAgent, id string) []int {
	return qemu.ProcessesOf(filepath.Join(f.dir, "vms", id))
}

// TestMigrationMovesDisk: what the guest wrote to its disk is there after
// a live migration (the NBD mirror) and after a cold one back (the files).
func TestMigrationMovesDisk(t *testing.T) {
	ctx := context.Background()
	src := startForkAgent(t, t.TempDir())
	dst := startForkAgent(t, t.TempDir())
	const id = "disk"
	script := "#!/bin/sh\nprintf 'kvm-marker:moved-by-mirror\\n' | dd of=/dev/vda conv=notrunc 2>/dev/null\nsync\necho kvm-marker-written\n"
	spec := migGuest(id, script, 128)
	if _, err := src.client.CreateVM(ctx, id, spec); err != nil {
		t.Fatal(err)
	}
	marker := regexp.MustCompile(`(?m)^kvm-guest-disk-marker vda kvm-marker:moved-by-mirror`)
	waitFor := func(f *forkAgent, re *regexp.Regexp, n int) {
		t.Helper()
		deadline := time.Now().Add(bootWait)
		for len(re.FindAllString(f.console(t, id), -1)) < n {
			if time.Now().After(deadline) {
				t.Fatalf("%s not %d times on the console:\n%s", re, n, f.console(t, id))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFor(src, regexp.MustCompile(`(?m)^kvm-marker-written`), 1)
	if mig := liveMigrate(t, src, dst, id, spec, agentapi.MigrateSpec{}); mig.State != agentapi.MigrationCompleted {
		t.Fatalf("live migration: %+v", mig)
	}
	t.Logf("disk mirrored: %+v", mig0(t, src, id).Disk)
	// A reboot on the target reads the marker from the mirrored overlay.
	if _, err := dst.client.Action(ctx, id, agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.Action(ctx, id, agentapi.ActionStart); err != nil {
		t.Fatal(err)
	}
	waitFor(dst, marker, 1)
	if _, err := dst.client.Action(ctx, id, agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	// Cold, back to the source (its migrated copy deleted first).
	if err := src.client.DeleteVM(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := src.client.PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec, Source: peerRef(dst)}); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.client.Migrate(ctx, id, agentapi.MigrateSpec{Target: peerRef(src)}); err != nil {
		t.Fatal(err)
	}
	if mig := waitMigrated(t, dst, id); mig.State != agentapi.MigrationCompleted || mig.Live {
		t.Fatalf("cold migration: %+v", mig)
	}
	if vm, err := src.client.GetVM(ctx, id); err != nil || vm.State != agentapi.StateStopped {
		t.Fatalf("after the cold migration: %+v, %v; want stopped", vm, err)
	}
	if _, err := src.client.Action(ctx, id, agentapi.ActionStart); err != nil {
		t.Fatal(err)
	}
	waitFor(src, marker, 1)
}

func mig0(t *testing.T, f *forkAgent, id string) agentapi.Migration {
	t.Helper()
	mig, err := f.client.Migration(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return mig
}
