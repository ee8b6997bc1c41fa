package upgradetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

func agentVMs(ctx context.Context, url string) ([]string, error) {
	vms, err := agentapi.NewClient(url, "agent-token").ListVMs(ctx)
	ids := make([]string, 0, len(vms))
	for _, v := range vms {
		ids = append(ids, v.ID)
	}
	return ids, err
}

// skewChurn is the bounded workload of the mixed-fleet tests, through the
// control API clients in turn: each round creates a VM pinned to each host,
// forks the first of them with two children spread over the fleet (so
// children pull the snapshot from an agent of another version), deletes
// the fork and one of the VMs. It returns the VMs it kept, as created.
func skewChurn(t *testing.T, ctx context.Context, prefix string, clients []*client.Client, hosts []string, rounds int) map[string]api.VMCreate {
	t.Helper()
	keep := map[string]api.VMCreate{}
	for r := range rounds {
		c := clients[r%len(clients)]
		var made []api.VM
		for i, h := range hosts {
			in := upgradeVM(fmt.Sprintf("%s-%d-%d", prefix, r, i))
			in.Host = h
			vm, err := c.CreateVM(ctx, in, "")
			if err != nil {
				t.Fatalf("round %d: create %s on %s through %s: %v", r, in.Name, h, c.Endpoint(), err)
			}
			keep[vm.ID] = in
			made = append(made, vm)
		}
		src := made[r%len(made)]
		f, err := c.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2, Placement: api.PlacementSpread}, "")
		if err != nil {
			t.Fatalf("round %d: fork %s (on %s) through %s: %v", r, src.ID, src.Host, c.Endpoint(), err)
		}
		if f.Phase != "ready" || len(f.Children) != 2 {
			t.Fatalf("round %d: fork %s of %s ended %q with %d children (error %q), want ready with 2", r, f.ID, src.ID, f.Phase, len(f.Children), f.Error)
		}
		for _, ch := range f.Children {
			if ch.ObservedState != api.StateRunning {
				t.Fatalf("round %d: fork child %s on %s is %s (%s)", r, ch.ID, ch.Host, ch.ObservedState, ch.Reason)
			}
		}
		if err := clients[(r+1)%len(clients)].DeleteFork(ctx, f.ID); err != nil {
			t.Fatalf("round %d: delete fork %s: %v", r, f.ID, err)
		}
		gone := made[(r+1)%len(made)]
		if err := c.DeleteVM(ctx, gone.ID); err != nil {
			t.Fatalf("round %d: delete %s: %v", r, gone.ID, err)
		}
		delete(keep, gone.ID)
	}
	return keep
}

// checkFleet waits until the fleet agrees through every client (the host
// monitor settles deletes in the background).
func checkFleet(t *testing.T, ctx context.Context, clients []*client.Client, agents map[string]*kvmdProc, keep map[string]api.VMCreate) {
	t.Helper()
	for _, c := range clients {
		waitFor(t, "the fleet agrees through "+c.Endpoint(), func() error { return fleetAgrees(ctx, c, agents, keep) })
	}
}

func hostNames(agents map[string]*kvmdProc) []string {
	var out []string
	for i := range len(agents) {
		out = append(out, fmt.Sprintf("host-%d", i))
	}
	return out
}

// Contract: agents of the previous release work with a control plane of
// this one. A control of this tree drives one agent of the previous
// release and one of this tree through creates, cross-version forks and
// deletes; nothing is lost and the plan stays empty.
func TestUpgradeOldAgentsNewControl(t *testing.T) {
	b := upgradeBinaries(t)
	ctx := ctxFor(t, 5*time.Minute)
	ctl := startUpgradeControl(t, b.current, postgres(t))
	agents := registerAndSync(t, ctx, ctl.client(), []*kvmdProc{startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.current)})
	clients := []*client.Client{ctl.client()}
	keep := skewChurn(t, ctx, "skew", clients, hostNames(agents), 4)
	checkFleet(t, ctx, clients, agents, keep)
	h, err := ctl.client().GetHost(ctx, "host-0")
	if err != nil || h.AgentAPILevel != 0 || h.AgentRefused != "" {
		t.Errorf("host-0 (agent of %s): %+v, %v; want no level (a release before levels) and not refused", b.oldCommit[:7], h, err)
	}
}

// Contract: agents of this release work with a control plane of the
// previous one (agents may be upgraded first).
func TestUpgradeNewAgentsOldControl(t *testing.T) {
	b := upgradeBinaries(t)
	ctx := ctxFor(t, 5*time.Minute)
	ctl := startUpgradeControl(t, b.old, postgres(t))
	agents := registerAndSync(t, ctx, ctl.client(), []*kvmdProc{startUpgradeAgent(t, b.current), startUpgradeAgent(t, b.current), startUpgradeAgent(t, b.old)})
	clients := []*client.Client{ctl.client()}
	keep := skewChurn(t, ctx, "skew", clients, hostNames(agents), 4)
	checkFleet(t, ctx, clients, agents, keep)
}

// Contract: control replicas of the previous release and of this one
// share one PostgreSQL database during a rolling upgrade (this one's
// migrations only expand: TestMigrationsOnlyExpand). The old replica
// starts first (the database as the previous release left it), the new
// one migrates it while the old one runs; creates, forks and deletes
// alternate between them over mixed agents, and both see the same fleet.
func TestUpgradeMixedReplicasOneDatabase(t *testing.T) {
	b := upgradeBinaries(t)
	ctx := ctxFor(t, 5*time.Minute)
	db := postgres(t)
	old := startUpgradeControl(t, b.old, db)
	agents := registerAndSync(t, ctx, old.client(), []*kvmdProc{startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.current)})
	before := skewChurn(t, ctx, "before", []*client.Client{old.client()}, hostNames(agents), 1)
	cur := startUpgradeControl(t, b.current, db)
	clients := []*client.Client{old.client(), cur.client()}
	keep := skewChurn(t, ctx, "skew", clients, hostNames(agents), 4)
	for id, in := range before {
		keep[id] = in
	}
	checkFleet(t, ctx, clients, agents, keep)
	// The old replica restarts on the database the new one migrated.
	old.restartAs(t, b.old)
	more := skewChurn(t, ctx, "after", clients, hostNames(agents), 2)
	for id, in := range more {
		keep[id] = in
	}
	checkFleet(t, ctx, clients, agents, keep)
}

// A build that claims an API level outside the contract is refused with
// an error naming both versions, and nothing is corrupted: an incompatible
// agent cannot be registered; a registered agent that comes back
// incompatible leaves its host refused (not alive, why on the host) with
// its VMs' rows intact, takes no new VM, and is back once the agent is
// compatible again; an incompatible control plane cannot register an
// agent, and an agent refuses its calls.
func TestUpgradeIncompatibleVersionRefused(t *testing.T) {
	b := upgradeBinaries(t)
	ctx := ctxFor(t, 5*time.Minute)
	db := postgres(t)
	ctl := startUpgradeControl(t, b.current, db)
	c := ctl.client()

	bad := startUpgradeAgent(t, b.incompatible)
	_, err := c.PutHost(ctx, "host-bad", api.HostPut{Address: bad.url})
	wantSkew(t, "register an incompatible agent", err, "0.2.0-dev (API level 2)", "9.0.0-incompatible (API level 9)")

	agents := registerAndSync(t, ctx, c, []*kvmdProc{startUpgradeAgent(t, b.current), startUpgradeAgent(t, b.current)})
	keep := skewChurn(t, ctx, "skew", []*client.Client{c}, hostNames(agents), 2)
	checkFleet(t, ctx, []*client.Client{c}, agents, keep)

	a0 := agents["host-0"]
	a0.restartAs(t, b.incompatible)
	waitFor(t, "host-0 refused", func() error {
		h, err := c.GetHost(ctx, "host-0")
		if err != nil {
			return err
		}
		if h.Alive || h.AgentRefused == "" {
			return fmt.Errorf("host-0 alive %v, refused %q", h.Alive, h.AgentRefused)
		}
		for _, want := range []string{"0.2.0-dev (API level 2)", "9.0.0-incompatible (API level 9)"} {
			if !strings.Contains(h.AgentRefused, want) {
				return fmt.Errorf("host-0 refused with %q, which does not name %q", h.AgentRefused, want)
			}
		}
		return nil
	})
	// Its VMs' rows stay; a create pinned to it is refused, not sent.
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range vms {
		if _, ok := keep[vm.ID]; ok && api.Gone(vm.ObservedState) {
			t.Errorf("vm %s on %s is %s while its agent is refused; want its row kept", vm.ID, vm.Host, vm.ObservedState)
		}
	}
	pinned := upgradeVM("skew-pinned-to-refused")
	pinned.Host = "host-0"
	if vm, err := c.CreateVM(ctx, pinned, ""); err == nil {
		t.Errorf("a create pinned to the refused host-0 succeeded: %+v", vm)
	}
	// The incompatible agent refuses this tree's calls itself.
	_, err = agentapi.NewClient(a0.url, "agent-token").ListVMs(ctx)
	wantAgentSkew(t, err)

	// An incompatible control plane cannot register a compatible agent.
	badCtl := startUpgradeControl(t, b.incompatible, postgres(t))
	_, err = badCtl.client().PutHost(ctx, "host-x", api.HostPut{Address: agents["host-1"].url})
	wantSkew(t, "an incompatible control registers an agent", err, "9.0.0-incompatible (API level 9)", "0.2.0-dev (API level 2)")

	// Back to a compatible agent: the host and its VMs are back.
	a0.restartAs(t, b.current)
	waitFor(t, "every host alive again", func() error { return allAlive(ctx, c) })
	checkFleet(t, ctx, []*client.Client{c}, agents, keep)
}

func wantSkew(t *testing.T, what string, err error, names ...string) {
	t.Helper()
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeVersionSkew {
		t.Fatalf("%s: %v; want a %s error", what, err, api.CodeVersionSkew)
	}
	for _, n := range names {
		if !strings.Contains(e.Message, n) {
			t.Errorf("%s: %q does not name %q", what, e.Message, n)
		}
	}
	t.Logf("%s: refused: %s", what, e.Message)
}

func wantAgentSkew(t *testing.T, err error) {
	t.Helper()
	var e *agentapi.Error
	if !errors.As(err, &e) || e.Code != agentapi.CodeVersionSkew {
		t.Fatalf("a call of this tree to the incompatible agent: %v; want %s", err, agentapi.CodeVersionSkew)
	}
	// The caller is this test binary's agent client (its release unstamped).
	for _, n := range []string{"9.0.0-incompatible (API level 9)", version.Self().String()} {
		if !strings.Contains(e.Message, n) {
			t.Errorf("the agent's refusal %q does not name %q", e.Message, n)
		}
	}
	t.Logf("the incompatible agent refused: %s", e.Message)
}
