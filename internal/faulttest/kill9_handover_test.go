package faulttest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// Issue 31 item 3 under kill -9: a real `kvmd agent` (sim driver), built
// with the kvmd_faultgate tag, stops at one step of a warm handover
// (agent.Hold*, through its KVMD_TEST_HANDOVER_HOLD variable) and is
// killed there: before the handover's journal record, after it and before
// the files move, after the move and before the answer, and after the
// answer before the journal is compacted. After a restart on the same
// state directory: the VM exists exactly once when its record was written
// (and always when the create was answered), not at all otherwise; no VM
// directory without its VM, no warm VM of the killed agent left (every one
// is an orphan, destroyed), the pool's count equal to its warm
// directories, and the host's figures counting each warm VM once. A create
// cut off before its answer, retried, makes no second VM.

var faultgateBuild struct {
	once sync.Once
	path string
	err  error
}

// buildFaultgateKVMD builds kvmd with the test-only hold points.
func buildFaultgateKVMD(t *testing.T) string {
	t.Helper()
	faultgateBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "kvmd-faultgate-bin-")
		if err != nil {
			faultgateBuild.err = err
			return
		}
		faultgateBuild.path = filepath.Join(dir, "kvmd")
		out, err := exec.Command("go", "build", "-tags", "kvmd_faultgate", "-o", faultgateBuild.path,
			"github.com/kvmfleet/terraform-provider-kvm/server").CombinedOutput()
		if err != nil {
			faultgateBuild.err = fmt.Errorf("go build -tags kvmd_faultgate kvmd: %v: %s", err, out)
		}
	})
	if faultgateBuild.err != nil {
		t.Fatal(faultgateBuild.err)
	}
	return faultgateBuild.path
}

var handoverSpec = agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}

func TestKill9AgentDuringWarmHandover(t *testing.T) {
	bin := buildFaultgateKVMD(t)
	for _, c := range []struct {
		step string
		made bool // the handover's record was durable
	}{
		{agent.HoldBeforeJournal, false},
		{agent.HoldAfterJournal, true},
		{agent.HoldAfterMove, true},
		{agent.HoldBeforeCompaction, true},
	} {
		t.Run(c.step, func(t *testing.T) { kill9DuringHandover(t, bin, c.step, c.made) })
	}
}

func kill9DuringHandover(t *testing.T, bin, step string, made bool) {
	ctx := ctxT(t, 2*time.Minute)
	ag := startKVMDAgent(t, bin)
	marker := filepath.Join(t.TempDir(), "held")
	ag.env = []string{"KVMD_TEST_HANDOVER_HOLD=" + step + ":" + marker}
	ag.restart(t)
	setHandoverPool(t, ctx, ag.client, 2)
	before := warmDirsOf(t, ag.stateDir)

	answer := make(chan error, 1)
	go func() {
		vm, err := ag.client.CreateVM(ctx, "x", handoverSpec)
		if err == nil && vm.StartedFrom != agentapi.StartedWarm {
			err = fmt.Errorf("create x started %s, want warm", vm.StartedFrom)
		}
		answer <- err
	}()
	eventually(t, "the agent holds at "+step, func() error {
		_, err := os.Stat(marker)
		return err
	})
	answered := false
	if step == agent.HoldBeforeCompaction {
		if err := <-answer; err != nil {
			t.Fatalf("create x before the compaction: %v", err)
		}
		answered = true
	}
	ag.kill()
	if !answered {
		if err := <-answer; err == nil {
			t.Fatal("create x answered although its agent was killed before the answer")
		}
	}
	ag.env = nil
	ag.restart(t)

	vms := settledHandover(t, ctx, ag, before)
	var got []string
	for _, vm := range vms {
		got = append(got, vm.ID+"/"+vm.StartedFrom)
	}
	var want []string
	if made {
		want = []string{"x/warm"}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("after the restart the agent has vms %v, want %v", got, want)
	}
	if made {
		n := 0
		for _, w := range before {
			if l, err := os.Readlink(filepath.Join(ag.stateDir, "pool", w)); err == nil && l == filepath.Join("..", "vms", "x") {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%d warm vms of %v link to vms/x, want exactly 1", n, before)
		}
	}
	if answered {
		return
	}
	// The cut-off create, retried, ends with x once.
	if _, err := ag.client.CreateVM(ctx, "x", handoverSpec); err != nil {
		t.Fatalf("retried create of x: %v", err)
	}
	vms = settledHandover(t, ctx, ag, before)
	if len(vms) != 1 || vms[0].ID != "x" {
		t.Fatalf("after the retried create the agent has %+v, want x once", vms)
	}
}

func setHandoverPool(t *testing.T, ctx context.Context, c *agentapi.Client, size int) {
	t.Helper()
	put := agentapi.PoolPut{Shapes: []agentapi.PoolShape{{VCPUs: handoverSpec.VCPUs, MemoryMiB: handoverSpec.MemoryMiB, DiskMiB: handoverSpec.DiskMiB, Size: size}}}
	if _, err := c.SetPool(ctx, handoverSpec.Image, put); err != nil {
		t.Fatal(err)
	}
	waitPoolReady(t, ctx, c, size)
}

func waitPoolReady(t *testing.T, ctx context.Context, c *agentapi.Client, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d ready warm vms", n), func() error {
		items, err := c.Pool(ctx)
		if err != nil {
			return err
		}
		for _, it := range items {
			if it.Image == handoverSpec.Image && it.Ready == n && it.Booting == 0 {
				return nil
			}
		}
		return fmt.Errorf("pool %+v", items)
	})
}

// warmDirsOf lists the warm VM directories (not links) of a state directory.
func warmDirsOf(t *testing.T, stateDir string) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(stateDir, "pool"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "warm-") {
			out = append(out, e.Name())
		}
	}
	return out
}

// settledHandover waits for the restarted agent's pool to refill and
// checks the state directory and the figures against its VMs, which it
// returns.
func settledHandover(t *testing.T, ctx context.Context, ag *kvmdAgent, killed []string) []agentapi.VM {
	t.Helper()
	waitPoolReady(t, ctx, ag.client, 2)
	vms, err := ag.client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, vm := range vms {
		ids = append(ids, vm.ID)
	}
	entries, err := os.ReadDir(filepath.Join(ag.stateDir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, e := range entries {
		dirs = append(dirs, e.Name())
	}
	if !slices.Equal(ids, dirs) {
		t.Errorf("the agent has vms %v, vms/ holds %v", ids, dirs)
	}
	warm := warmDirsOf(t, ag.stateDir)
	for _, w := range killed {
		if slices.Contains(warm, w) {
			t.Errorf("warm vm %s of the killed agent is still a warm vm: %v", w, warm)
		}
	}
	info, err := ag.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pooled := int64(0)
	for _, p := range info.Pool {
		pooled += int64(p.Ready + p.Booting)
	}
	if pooled != int64(len(warm)) || info.Warm.VCPUs != pooled || info.Warm.MemoryMiB != pooled*handoverSpec.MemoryMiB {
		t.Errorf("the pool counts %d warm vms holding %+v; pool/ has %d: %v", pooled, info.Warm, len(warm), warm)
	}
	if info.VMCount != len(vms) || info.Allocated.MemoryMiB != int64(len(vms))*handoverSpec.MemoryMiB {
		t.Errorf("allocated %+v for %d vms (vm count %d)", info.Allocated, len(vms), info.VMCount)
	}
	if info.Free.MemoryMiB != info.Capacity.MemoryMiB-info.Allocated.MemoryMiB-info.Warm.MemoryMiB ||
		info.Free.VCPUs != info.Capacity.VCPUs-info.Allocated.VCPUs-info.Warm.VCPUs {
		t.Errorf("free %+v, want capacity %+v - vms %+v - warm %+v", info.Free, info.Capacity, info.Allocated, info.Warm)
	}
	if b, err := os.ReadFile(filepath.Join(ag.stateDir, "pool-journal")); err != nil || len(b) != 0 {
		t.Errorf("pool-journal after the restart = %q, %v; want compacted (empty)", b, err)
	}
	return vms
}
