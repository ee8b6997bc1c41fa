package control_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// startRacks starts a control API with six sim hosts h1..h6 labelled
// rack=a, a, b, b, c, c, and returns it with each host's rack.
func startRacks(t *testing.T, dbURL string) (*testenv.Control, map[string]string) {
	t.Helper()
	c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
	racks := map[string]string{}
	for i, rack := range []string{"a", "a", "b", "b", "c", "c"} {
		name := fmt.Sprintf("h%d", i+1)
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 64, MemoryMiB: 64 << 10, DiskMiB: 1 << 20})
		if _, err := c.Client.PutHost(ctxT(t), name, api.HostPut{Address: a.Address, Labels: map[string]string{"rack": rack}}); err != nil {
			t.Fatal(err)
		}
		racks[name] = rack
	}
	return c, racks
}

func grouped(name string, c api.Constraints) api.VMCreate {
	in := smallVM(name)
	in.Constraints = &c
	return in
}

func TestGroupSpreadByRackLands444(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c, racks := startRacks(t, dbURL)
		perRack := map[string]int{}
		for i := range 12 {
			vm, err := c.Client.CreateVM(ctx, grouped(fmt.Sprintf("web-%d", i), api.Constraints{Group: "web", SpreadBy: "label:rack"}), "")
			if err != nil {
				t.Fatal(err)
			}
			perRack[racks[vm.Host]]++
			if vm.Constraints == nil || vm.Constraints.Group != "web" || vm.Constraints.SpreadBy != "label:rack" {
				t.Errorf("create answered constraints %+v", vm.Constraints)
			}
		}
		if perRack["a"] != 4 || perRack["b"] != 4 || perRack["c"] != 4 {
			t.Errorf("12 VMs of group web spread by rack landed %v, want 4/4/4", perRack)
		}
		got, err := c.Client.GetVM(ctx, mustVMID(t, c, "web-11"))
		if err != nil {
			t.Fatal(err)
		}
		if got.Placement == nil || got.Placement.Terms["spread"] != 3 {
			t.Errorf("the 12th VM joined a rack holding 3 of the group: placement %+v, want a spread term of 3", got.Placement)
		}
		checkLedger(t, c.Store)
	})
}

func mustVMID(t *testing.T, c *testenv.Control, name string) string {
	t.Helper()
	l, err := c.Client.ListVMs(context.Background(), client.ListOptions{Name: name})
	if err != nil || len(l.Items) != 1 {
		t.Fatalf("find vm %s: %v %+v", name, err, l)
	}
	return l.Items[0].ID
}

func rejections(t *testing.T, err error) map[string]string {
	t.Helper()
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity {
		t.Fatalf("want 409 no_capacity, got %v", err)
	}
	out := map[string]string{}
	list, _ := e.Details["rejected"].([]any)
	for _, r := range list {
		m := r.(map[string]any)
		out[m["host"].(string)] = m["reason"].(string)
	}
	return out
}

func metricValue(t *testing.T, c *testenv.Control, series string) string {
	t.Helper()
	resp, err := http.Get(c.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			return v
		}
	}
	return ""
}

func TestMaxPerDomainOneIsStrictAntiAffinity(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c, _ := startRacks(t, dbURL)
		db := api.Constraints{Group: "db", SpreadBy: "host", MaxPerDomain: 1}
		seen := map[string]string{}
		for i := range 6 {
			vm, err := c.Client.CreateVM(ctx, grouped(fmt.Sprintf("db-%d", i), db), "")
			if err != nil {
				t.Fatal(err)
			}
			if other, ok := seen[vm.Host]; ok {
				t.Errorf("%s and %s share host %s", other, vm.Name, vm.Host)
			}
			seen[vm.Host] = vm.Name
		}
		_, err := c.Client.CreateVM(ctx, grouped("db-6", db), "")
		reasons := rejections(t, err)
		if len(reasons) != 6 {
			t.Errorf("the 7th create explains %d hosts, want 6: %v", len(reasons), reasons)
		}
		for h, r := range reasons {
			if r != api.ReasonGroupCap {
				t.Errorf("host %s rejected for %q, want group_cap", h, r)
			}
		}
		if v := metricValue(t, c, `kvm_placement_rejections_total{reason="group_cap"}`); v == "" || v == "0" {
			t.Errorf("kvm_placement_rejections_total{reason=group_cap} = %q, want the 7th create's rejections counted", v)
		}
		// Another group and VMs without a group are not held back.
		if _, err := c.Client.CreateVM(ctx, grouped("cache-0", api.Constraints{Group: "cache", MaxPerDomain: 1}), ""); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Client.CreateVM(ctx, smallVM("plain"), ""); err != nil {
			t.Fatal(err)
		}
		// A delete gives the slot back.
		if err := c.Client.DeleteVM(ctx, mustVMID(t, c, "db-0")); err != nil {
			t.Fatal(err)
		}
		vm, err := c.Client.CreateVM(ctx, grouped("db-6", db), "")
		if err != nil {
			t.Fatalf("after a delete the group has a free host: %v", err)
		}
		if vm.Host != vmHostBefore(seen, "db-0") {
			t.Errorf("db-6 went to %s, want %s, the only host without the group", vm.Host, vmHostBefore(seen, "db-0"))
		}
		checkLedger(t, c.Store)
	})
}

func vmHostBefore(seen map[string]string, name string) string {
	for h, n := range seen {
		if n == name {
			return h
		}
	}
	return ""
}

func TestHostLabelsExcludeHostsAndSayLabels(t *testing.T) {
	ctx := ctxT(t)
	c, racks := startRacks(t, "")
	dry, err := c.Client.Place(ctx, api.PlacementRequest{Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024,
		Constraints: &api.Constraints{HostLabels: map[string]string{"rack": "b"}}})
	if err != nil {
		t.Fatal(err)
	}
	var ranked []string
	for _, r := range dry.Ranked {
		ranked = append(ranked, r.Host)
	}
	if !slices.Equal(ranked, []string{"h3", "h4"}) {
		t.Errorf("dry run ranked %v, want only rack b [h3 h4]", ranked)
	}
	for _, r := range dry.Rejected {
		if r.Reason != api.ReasonLabels || !strings.Contains(r.Detail, "needs rack=b, has rack=") {
			t.Errorf("dry run rejected %s for %q (%s), want labels", r.Host, r.Reason, r.Detail)
		}
	}
	if len(dry.Rejected) != 4 {
		t.Errorf("dry run rejected %d hosts, want 4", len(dry.Rejected))
	}
	for i := range 4 {
		vm, err := c.Client.CreateVM(ctx, grouped(fmt.Sprintf("b-%d", i), api.Constraints{HostLabels: map[string]string{"rack": "b"}}), "")
		if err != nil {
			t.Fatal(err)
		}
		if racks[vm.Host] != "b" {
			t.Errorf("VM %s landed on %s in rack %s, want rack b", vm.Name, vm.Host, racks[vm.Host])
		}
	}
	_, err = c.Client.CreateVM(ctx, grouped("nowhere", api.Constraints{HostLabels: map[string]string{"rack": "z"}}), "")
	nowhere := rejections(t, err)
	if len(nowhere) != 6 {
		t.Errorf("%d hosts explained, want 6: %v", len(nowhere), nowhere)
	}
	for h, r := range nowhere {
		if r != api.ReasonLabels {
			t.Errorf("host %s rejected for %q, want labels", h, r)
		}
	}
	if v := metricValue(t, c, `kvm_placement_rejections_total{reason="labels"}`); v == "" || v == "0" {
		t.Errorf("labels rejections not counted: %q", v)
	}
}

// A host whose labels change under placed VMs keeps them (nothing moves)
// and the VMs report the violation; changing a VM's constraints stores
// them and does not move it either.
func TestLabelChangeIsReportedNeverMoved(t *testing.T) {
	ctx := ctxT(t)
	c, _ := startRacks(t, "")
	vm, err := c.Client.CreateVM(ctx, grouped("pinned-to-a", api.Constraints{HostLabels: map[string]string{"rack": "a"}}), "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.ConstraintsViolated != "" {
		t.Errorf("fresh VM reports a violation: %q", vm.ConstraintsViolated)
	}
	h, err := c.Client.GetHost(ctx, vm.Host)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.PutHost(ctx, vm.Host, api.HostPut{Address: h.Address, Labels: map[string]string{"rack": "x"}}); err != nil {
		t.Fatal(err)
	}
	got, err := c.Client.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Host != vm.Host || got.ObservedState != api.StateRunning {
		t.Errorf("VM moved or stopped: host %s state %s", got.Host, got.ObservedState)
	}
	want := fmt.Sprintf("host %s no longer has label rack=a (now rack=x)", vm.Host)
	if got.ConstraintsViolated != want {
		t.Errorf("constraints_violated = %q, want %q", got.ConstraintsViolated, want)
	}
	// New constraints are stored and checked, the VM stays.
	patched, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{Constraints: &api.Constraints{HostLabels: map[string]string{"rack": "x"}}})
	if err != nil {
		t.Fatal(err)
	}
	if patched.Host != vm.Host || patched.Constraints == nil || patched.Constraints.HostLabels["rack"] != "x" || patched.ConstraintsViolated != "" {
		t.Errorf("after PATCH: host %s constraints %+v violated %q", patched.Host, patched.Constraints, patched.ConstraintsViolated)
	}
	cleared, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{Constraints: &api.Constraints{}})
	if err != nil {
		t.Fatal(err)
	}
	if cleared.Constraints != nil {
		t.Errorf("an empty constraints object must clear them: %+v", cleared.Constraints)
	}
}

func TestConstraintsBadInputIs400AndCreatesNothing(t *testing.T) {
	ctx := ctxT(t)
	c, _ := startRacks(t, "")
	bad := map[string]api.Constraints{
		"unknown spread_by form": {Group: "g", SpreadBy: "rack"},
		"empty label key":        {Group: "g", SpreadBy: "label:"},
		"negative cap":           {Group: "g", MaxPerDomain: -1},
		"cap without a group":    {MaxPerDomain: 2},
		"spread without a group": {SpreadBy: "host"},
		"bad group name":         {Group: "no spaces"},
		"bad host label key":     {HostLabels: map[string]string{"": "x"}},
	}
	for name, cons := range bad {
		t.Run(name, func(t *testing.T) {
			_, err := noRetry(c).CreateVM(ctx, grouped("bad", cons), "")
			var e *client.Error
			if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != api.CodeInvalid || !strings.Contains(e.Message, "constraints.") {
				t.Errorf("create: %v, want 400 invalid naming the constraints field", err)
			}
			_, err = c.Client.Place(ctx, api.PlacementRequest{Image: "sim", VCPUs: 1, MemoryMiB: 1, DiskMiB: 1, Constraints: &cons})
			if !errors.As(err, &e) || e.Status != http.StatusBadRequest {
				t.Errorf("dry run: %v, want 400", err)
			}
		})
	}
	vms, err := c.Client.AllVMs(ctx, client.ListOptions{})
	if err != nil || len(vms) != 0 {
		t.Errorf("bad input created %d VMs (%v)", len(vms), err)
	}
}

// Two replicas on one PostgreSQL, 100 creates of one group at once with
// max_per_domain = 1 over 40 hosts: the database gives each host's slot
// to exactly one of them.
func TestGroupCapHoldsAcrossReplicas(t *testing.T) {
	url := testenv.PostgresURL(t)
	r1 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	r2 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	for i := range 40 {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 64, MemoryMiB: 64 << 10, DiskMiB: 1 << 20})
		r1.RegisterHost(t, fmt.Sprintf("host-%02d", i), a.Address)
	}
	ctx := ctxT(t)
	var (
		wg              sync.WaitGroup
		mu              sync.Mutex
		hosts           = map[string]int{}
		created, capped int
	)
	for i := range 100 {
		r := []*testenv.Control{r1, r2}[i%2]
		wg.Go(func() {
			vm, err := r.Client.CreateVM(ctx, grouped(fmt.Sprintf("anti-%03d", i), api.Constraints{Group: "anti", SpreadBy: "host", MaxPerDomain: 1}), "")
			mu.Lock()
			defer mu.Unlock()
			var e *client.Error
			switch {
			case err == nil:
				created++
				hosts[vm.Host]++
			case errors.As(err, &e) && e.Code == api.CodeNoCapacity:
				capped++
				for h, reason := range e.Details["rejected"].([]any) {
					if m := reason.(map[string]any); m["reason"] != api.ReasonGroupCap {
						t.Errorf("refusal %d: host %v rejected for %v, want group_cap", h, m["host"], m["reason"])
					}
				}
			default:
				t.Errorf("create anti-%03d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if created != 40 || capped != 60 || len(hosts) != 40 {
		t.Errorf("created %d on %d distinct hosts, refused %d; want 40 on 40 and 60 refused", created, len(hosts), capped)
	}
	for h, n := range hosts {
		if n != 1 {
			t.Errorf("host %s holds %d VMs of the group", h, n)
		}
	}
	checkLedger(t, r1.Store)
}

// A fork's children spread by the fork's constraints: colocate would put
// them all on the source host; spread_by host with a cap of one puts each
// on its own host.
func TestForkChildrenSpreadByConstraints(t *testing.T) {
	ctx := ctxT(t)
	c, _ := startRacks(t, "")
	src, err := c.Client.CreateVM(ctx, smallVM("source"), "")
	if err != nil {
		t.Fatal(err)
	}
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 6, Placement: api.PlacementColocate,
		Constraints: &api.Constraints{SpreadBy: "host", MaxPerDomain: 1}}, "")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "fork ready", func() bool {
		f, err = c.Client.GetFork(ctx, f.ID)
		return err == nil && f.Phase == api.ForkReady
	})
	seen := map[string]bool{}
	for _, ch := range f.Children {
		if seen[ch.Host] {
			t.Errorf("two children on host %s", ch.Host)
		}
		seen[ch.Host] = true
	}
	if len(seen) != 6 || f.Constraints == nil || f.Constraints.SpreadBy != "host" {
		t.Errorf("children on %d hosts (want 6), fork constraints %+v", len(seen), f.Constraints)
	}
	// A seventh child has no host left: refused with group_cap everywhere.
	n := 7
	_, err = c.Client.UpdateFork(ctx, f.ID, api.ForkPatch{Count: &n})
	seventh := rejections(t, err)
	if len(seventh) != 6 {
		t.Errorf("seventh child: %d hosts explained, want 6: %v", len(seventh), seventh)
	}
	for h, r := range seventh {
		if r != api.ReasonGroupCap {
			t.Errorf("seventh child: host %s rejected for %q, want group_cap", h, r)
		}
	}
	f, err = c.Client.GetFork(ctx, f.ID)
	if err != nil {
		t.Fatal(err)
	}
	hostsNow := map[string]bool{}
	for _, ch := range f.Children {
		if ch.ObservedState == api.StateRunning {
			hostsNow[ch.Host] = true
		}
	}
	if len(hostsNow) != 6 {
		t.Errorf("running children on %d distinct hosts, want 6 and no seventh", len(hostsNow))
	}
	_, err = c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 1, Placement: api.PlacementSpread,
		Constraints: &api.Constraints{MaxPerDomain: -1}}, "")
	var e *client.Error
	if !errors.As(err, &e) || e.Status != http.StatusBadRequest {
		t.Errorf("fork with a negative cap: %v, want 400", err)
	}
	checkLedger(t, c.Store)
}

// A create that fails after its reservation gives the group's slot back
// with its capacity: the only host of a group capped at one per host takes
// the retry.
func TestFailedCreateGivesGroupSlotBack(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		var failures atomic.Int64
		failures.Store(1)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, Hooks: &control.Hooks{
			AfterAgentCreate: func(context.Context, string) error {
				if failures.Add(-1) >= 0 {
					return errors.New("injected database failure")
				}
				return nil
			},
		}})
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16 << 10, DiskMiB: 1 << 20})
		c.RegisterHost(t, "h1", a.Address)
		solo := api.Constraints{Group: "solo", SpreadBy: "host", MaxPerDomain: 1}
		if _, err := noRetry(c).CreateVM(ctx, grouped("solo-0", solo), ""); err == nil {
			t.Fatal("the injected failure must fail the first create")
		}
		vm, err := c.Client.CreateVM(ctx, grouped("solo-0", solo), "")
		if err != nil {
			t.Fatalf("retry after a failed create: %v (its group slot was not given back?)", err)
		}
		if vm.Host != "h1" {
			t.Errorf("retry on %s, want h1", vm.Host)
		}
		_, err = c.Client.CreateVM(ctx, grouped("solo-1", solo), "")
		if r := rejections(t, err); r["h1"] != api.ReasonGroupCap {
			t.Errorf("second VM of the group: h1 rejected for %q, want group_cap", r["h1"])
		}
		checkLedger(t, c.Store)
	})
}
