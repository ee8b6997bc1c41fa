package agent_test

// The handover journal (pool_journal.go), in process with the sim driver:
// the state directory is copied at each step of a warm handover, as a
// crash there leaves it, and an agent started on the copy must finish or
// drop the handover. The kill -9 of a real `kvmd agent` at the same steps
// is internal/faulttest/kill9_handover_test.go.

import (
	"context"
	"fmt"
	"hash/crc32"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// startHookedPoolAgent is startPoolAgent with a handover hook.
func startHookedPoolAgent(t *testing.T, dir string, d agent.Driver, hook func(step string)) *poolAgent {
	t.Helper()
	logs := &syncBuffer{}
	cfg := agent.Config{
		StateDir: dir, Driver: d, Token: token,
		Capacity: agentapi.Resources{VCPUs: 64, MemoryMiB: 64 << 10, DiskMiB: 1 << 20},
		Logger:   slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if hook != nil {
		agent.SetHandoverHook(&cfg, hook)
	}
	a, err := agent.New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	srv := httptest.NewServer(a.Handler())
	h := &poolAgent{dir: dir, driver: d, agent: a, srv: srv, logs: logs,
		client: agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0))}
	t.Cleanup(h.stop)
	return h
}

// crashImage copies the state directory as it is now (links kept): what a
// kill -9 at this instant leaves.
func crashImage(t *testing.T, dir string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "state")
	if out, err := exec.Command("cp", "-a", dir, dst).CombinedOutput(); err != nil {
		t.Fatalf("copy the state directory: %v: %s", err, out)
	}
	return dst
}

// imageAt runs a warm create of VM id on a fresh agent with a pool of 2
// and returns a copy of its state directory taken at handover step, the
// warm VM it took and whether the create was answered with it.
func imageAt(t *testing.T, step, id string) (image, warm string, answered bool) {
	t.Helper()
	var once sync.Once
	taken := make(chan string, 1)
	var h *poolAgent
	hook := func(at string) {
		if at == step {
			once.Do(func() { taken <- crashImage(t, h.dir) })
		}
	}
	h = startHookedPoolAgent(t, t.TempDir(), newPoolDriver(), hook)
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	before := warmDirs(t, h.dir)
	vm, err := h.client.CreateVM(ctx, id, poolSpec)
	if err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create %s = %+v, %v; want a warm start", id, vm, err)
	}
	image = <-taken // before-compaction: the filler compacts after the answer
	for _, w := range before {
		if l, err := os.Readlink(filepath.Join(h.dir, "pool", w)); err == nil && l == filepath.Join("..", "vms", id) {
			warm = w
		}
	}
	if warm == "" {
		t.Fatalf("no warm vm of %v became %s", before, id)
	}
	return image, warm, step == agent.HoldBeforeCompaction
}

// checkSettled checks what every restart must leave: each VM once, the
// VM directories exactly the VMs, the warm directories exactly the pool's
// warm VMs (none of them one that was handed out), and the host's
// figures counting each warm VM once.
func checkSettled(t *testing.T, h *poolAgent, handed string) []agentapi.VM {
	t.Helper()
	ctx := context.Background()
	waitReady(t, h, 2)
	vms, err := h.client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, vm := range vms {
		ids = append(ids, vm.ID)
	}
	entries, err := os.ReadDir(filepath.Join(h.dir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, e := range entries {
		dirs = append(dirs, e.Name())
	}
	if !slices.Equal(ids, dirs) {
		t.Errorf("the agent lists vms %v, vms/ holds %v", ids, dirs)
	}
	warm := warmDirs(t, h.dir)
	if slices.Contains(warm, handed) {
		t.Errorf("warm vm %s, handed over before the crash, is a warm vm again: %v", handed, warm)
	}
	info, err := h.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pooled := int64(0)
	for _, p := range info.Pool {
		pooled += int64(p.Ready + p.Booting)
	}
	if pooled != int64(len(warm)) || info.Warm.VCPUs != pooled || info.Warm.MemoryMiB != pooled*poolSpec.MemoryMiB {
		t.Errorf("the pool counts %d warm vms holding %+v; pool/ has %d: %v", pooled, info.Warm, len(warm), warm)
	}
	if info.Allocated.MemoryMiB != int64(len(vms))*poolSpec.MemoryMiB || info.VMCount != len(vms) {
		t.Errorf("allocated %+v for %d vms, want %d MiB", info.Allocated, len(vms), int64(len(vms))*poolSpec.MemoryMiB)
	}
	if info.Free.MemoryMiB != info.Capacity.MemoryMiB-info.Allocated.MemoryMiB-info.Warm.MemoryMiB {
		t.Errorf("free %d MiB, want capacity %d - vms %d - warm %d", info.Free.MemoryMiB, info.Capacity.MemoryMiB, info.Allocated.MemoryMiB, info.Warm.MemoryMiB)
	}
	if b, err := os.ReadFile(filepath.Join(h.dir, "pool-journal")); err != nil || len(b) != 0 {
		t.Errorf("pool-journal after the start = %q, %v; want compacted (empty)", b, err)
	}
	return vms
}

// TestHandoverCrashAtEachStep: a crash at each step of a warm handover,
// also with the unsynced moves lost (a power cut after the record's sync),
// leaves the VM either never made (before the record: the warm VM an
// orphan, destroyed) or made exactly once.
func TestHandoverCrashAtEachStep(t *testing.T) {
	type loss struct {
		name string
		// lose undoes, in the crash image, moves that were not synced.
		lose func(t *testing.T, dir, warm, id string)
	}
	none := loss{"nothing lost", func(*testing.T, string, string, string) {}}
	metadata := loss{"metadata lost", func(t *testing.T, dir, _, id string) {
		if err := os.Truncate(filepath.Join(dir, "vms", id, "vm.json"), 0); err != nil {
			t.Fatal(err)
		}
	}}
	rename := loss{"rename and link lost", func(t *testing.T, dir, warm, id string) {
		link := filepath.Join(dir, "pool", warm)
		if err := os.Remove(link); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "vms", id), link); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(filepath.Join(link, "vm.json")); err != nil {
			t.Fatal(err)
		}
	}}
	cases := []struct {
		step   string
		losses []loss
		made   bool
	}{
		{agent.HoldBeforeJournal, []loss{none}, false},
		{agent.HoldAfterJournal, []loss{none}, true},
		{agent.HoldAfterMove, []loss{none, metadata, rename}, true},
		{agent.HoldBeforeCompaction, []loss{none, metadata, rename}, true},
	}
	for _, c := range cases {
		for _, l := range c.losses {
			t.Run(c.step+"/"+l.name, func(t *testing.T) {
				image, warm, answered := imageAt(t, c.step, "x")
				l.lose(t, image, warm, "x")
				h := startHookedPoolAgent(t, image, newPoolDriver(), nil)
				vms := checkSettled(t, h, warm)
				var got []string
				for _, vm := range vms {
					got = append(got, vm.ID+"/"+vm.StartedFrom)
				}
				switch {
				case c.made && !slices.Equal(got, []string{"x/warm"}):
					t.Fatalf("after the restart the vms are %v, want x once, started warm", got)
				case !c.made && len(got) != 0:
					t.Fatalf("after the restart the vms are %v, want none: the handover never recorded", got)
				}
				if c.made {
					if l, err := os.Readlink(filepath.Join(image, "pool", warm)); err != nil || l != filepath.Join("..", "vms", "x") {
						t.Errorf("pool/%s = %q, %v; want a link to ../vms/x", warm, l, err)
					}
				}
				if answered || !c.made {
					return
				}
				// The create was cut off before its answer: its retry finds
				// the VM and makes no second one.
				vm, err := h.client.CreateVM(context.Background(), "x", poolSpec)
				if err != nil || vm.StartedFrom != agentapi.StartedWarm {
					t.Fatalf("retried create of x = %+v, %v; want the handed-over vm", vm, err)
				}
				checkSettled(t, h, warm)
			})
		}
	}
}

// TestHandoverJournalStaleAndTornRecords: a record whose VM was deleted and
// created again (cold) since changes nothing; a torn last record is
// ignored.
func TestHandoverJournalStaleAndTornRecords(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	held := make(chan struct{})
	hook := func(at string) {
		if at == agent.HoldBeforeCompaction {
			once.Do(func() { close(held); <-release })
		}
	}
	h := startHookedPoolAgent(t, t.TempDir(), newPoolDriver(), hook)
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(2)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 2)
	if vm, err := h.client.CreateVM(ctx, "x", poolSpec); err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create x = %+v, %v", vm, err)
	}
	<-held // the record of x stays in the journal
	if err := h.client.DeleteVM(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	cold := poolSpec
	cold.NoWarm = true
	if vm, err := h.client.CreateVM(ctx, "x", cold); err != nil || vm.StartedFrom != agentapi.StartedCold {
		t.Fatalf("create x again = %+v, %v", vm, err)
	}
	image := crashImage(t, h.dir)
	close(release)
	journal := filepath.Join(image, "pool-journal")
	if b, err := os.ReadFile(journal); err != nil || !strings.Contains(string(b), `"vm":{"version":1,"id":"x"`) {
		t.Fatalf("pool-journal = %q, %v; want the record of x's handover", b, err)
	}
	// A torn record after it: a write cut by the crash.
	body := `{"op":"handover","warm_vm":"warm-0123456789ab","vm":{"version":1,"id":"y"`
	f, err := os.OpenFile(journal, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintf(f, "%08x %s", crc32.Checksum([]byte(body), crc32.MakeTable(crc32.Castagnoli)), body); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()

	h2 := startHookedPoolAgent(t, image, newPoolDriver(), nil)
	vms := checkSettled(t, h2, "")
	if len(vms) != 1 || vms[0].ID != "x" || vms[0].StartedFrom != agentapi.StartedCold {
		t.Fatalf("after the restart the vms are %+v; want x once, the cold one", vms)
	}
	if !strings.Contains(h2.logs.String(), "torn last record") {
		t.Errorf("the torn record was not logged:\n%s", h2.logs.String())
	}
}
