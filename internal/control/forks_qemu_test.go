package control_test

import (
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var tickLine = regexp.MustCompile(`(?m)^tick ([0-9]+)\r?$`)

func ticks(con string) []int {
	var out []int
	for _, m := range tickLine.FindAllStringSubmatch(con, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

// waitTicks waits until the VM's console shows at least n tick lines.
func waitTicks(t *testing.T, c *agentapi.Client, id string, n int) []int {
	t.Helper()
	ctx := ctxT(t)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, err := c.Console(ctx, id)
		if err != nil {
			t.Fatalf("console of %s: %v", id, err)
		}
		if ts := ticks(con); len(ts) >= n {
			return ts
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: fewer than %d tick lines; console:\n%s", id, n, con)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestForkRealGuestsThroughTheControlAPI forks a counting busybox guest
// into three children with real QEMU: h1 has room for the source and one
// child, so two spill to h2, which pulls the snapshot. Every child's
// console continues from the snapshot's tick, and so does the source.
func TestForkRealGuestsThroughTheControlAPI(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
	if testing.Short() {
		t.Skip("boots real guests")
	}
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	agents := map[string]*testenv.Agent{
		"h1": testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 2, MemoryMiB: 2048, DiskMiB: 8192}),
		"h2": testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 4, MemoryMiB: 4096, DiskMiB: 8192}),
	}
	for name, a := range agents {
		c.RegisterHost(t, name, a.Address)
	}
	src, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "counter", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, Host: "h1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	waitTicks(t, agents["h1"].Client, src.ID, 2)

	// pause_source keeps the source at the snapshot point, so that its last
	// tick is the one every child must continue from.
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 3, PauseSource: true, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatal(err)
	}
	if f.Phase != api.ForkReady || len(f.Children) != 3 {
		t.Fatalf("fork = %+v, want ready with 3 children", f)
	}
	srcTicks := waitTicks(t, agents["h1"].Client, src.ID, 1)
	point := srcTicks[len(srcTicks)-1]
	var hosts []string
	for _, ch := range f.Children {
		hosts = append(hosts, ch.Host)
		if ch.StartedFrom != agentapi.StartedSnapshot || ch.ObservedState != api.StateRunning {
			t.Errorf("child %s: %s from %s, want running from the snapshot", ch.Name, ch.ObservedState, ch.StartedFrom)
		}
	}
	if !slices.Equal(hosts, []string{"h1", "h2", "h2"}) {
		t.Errorf("children on %v, want one on the source host and two spilled to h2", hosts)
	}
	if _, err := agents["h1"].Client.Action(ctx, src.ID, agentapi.ActionResume); err != nil {
		t.Fatalf("resume source: %v", err)
	}
	t.Logf("snapshot after tick %d; children on %v", point, hosts)
	for _, ch := range f.Children {
		ts := waitTicks(t, agents[ch.Host].Client, ch.ID, 2)
		if ts[0] != point+1 || ts[1] != point+2 {
			t.Errorf("child %s on %s counts %v; the snapshot was taken after tick %d", ch.Name, ch.Host, ts[:2], point)
		}
	}
	if ts := waitTicks(t, agents["h1"].Client, src.ID, len(srcTicks)+1); ts[len(srcTicks)] != point+1 {
		t.Errorf("source continues with tick %d after tick %d", ts[len(srcTicks)], point)
	}

	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
	for name, a := range agents {
		vms, err := a.Client.ListVMs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		if name == "h1" {
			want = 1
		}
		if len(vms) != want {
			t.Errorf("host %s runs %d VMs after the fork's delete, want %d", name, len(vms), want)
		}
		if _, err := a.Client.GetSnapshot(ctx, f.ID); err == nil {
			t.Errorf("host %s still holds the snapshot after the fork's delete", name)
		}
	}
	checkLedger(t, c.Store)
}
