package provider

import (
	"context"
	"errors"
	"math"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

func TestListCacheLoadsOnceForConcurrentReaders(t *testing.T) {
	var loads atomic.Int32
	c := newListCache(time.Hour, func(context.Context) ([]api.VM, error) {
		loads.Add(1)
		return []api.VM{{ID: "a"}, {ID: "b"}}, nil
	}, func(vm api.VM) string { return vm.ID })

	var wg sync.WaitGroup
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, ok := c.get(context.Background(), "a"); !ok {
				t.Errorf("cache miss for a listed VM")
			}
		}()
	}
	wg.Wait()
	if _, ok := c.get(context.Background(), "zzz"); ok {
		t.Fatalf("cache hit for a VM the list does not hold")
	}
	if n := loads.Load(); n != 1 {
		t.Fatalf("50 concurrent reads and a miss loaded the list %d times, want 1", n)
	}

	c.invalidate()
	c.get(context.Background(), "a")
	if n := loads.Load(); n != 2 {
		t.Fatalf("a read after invalidate loaded %d times in all, want 2", n)
	}
}

func TestListCacheFailedLoadIsNotRetriedByEveryReader(t *testing.T) {
	var loads atomic.Int32
	c := newListCache(time.Hour, func(context.Context) ([]api.VM, error) {
		loads.Add(1)
		return nil, errors.New("control API down")
	}, func(vm api.VM) string { return vm.ID })
	for i := 0; i < 10; i++ {
		if _, ok := c.get(context.Background(), "a"); ok {
			t.Fatalf("hit after a failed load")
		}
	}
	if n := loads.Load(); n != 1 {
		t.Fatalf("10 reads after a failed load listed %d times, want 1", n)
	}
}

func TestObservedPowerState(t *testing.T) {
	for _, tc := range []struct {
		desired, observed, want string
	}{
		{"running", "running", "running"},
		{"running", "stopped", "stopped"}, // stopped behind Terraform's back
		{"stopped", "running", "running"}, // started behind its back
		{"running", "unknown", "running"}, // dead host: no news is no drift
		{"stopped", "creating", "stopped"},
		{"running", "error", "running"},
		{"", "paused", "running"},
	} {
		got := observedPowerState(api.VM{PowerState: tc.desired, ObservedState: tc.observed})
		if got != tc.want {
			t.Errorf("desired %q observed %q: power_state %q, want %q", tc.desired, tc.observed, got, tc.want)
		}
	}
}

func TestPlacementSummary(t *testing.T) {
	p := &api.Placement{Host: "h1", Score: 1.078531, Rejected: []api.Rejection{
		{Host: "h5", Reason: "not alive"}, {Host: "h2", Reason: "not enough memory"},
		{Host: "h4", Reason: "no image"}, {Host: "h3", Reason: "not schedulable"},
	}}
	want := "placed on h1 (score 1.07853); rejected h2: not enough memory; h3: not schedulable; h4: no image; and 1 more"
	if got := placementSummary("h1", p); got != want {
		t.Fatalf("summary\n got %q\nwant %q", got, want)
	}
	if got := placementSummary("h1", &api.Placement{Score: 2}); got != "placed on h1 (score 2.00000)" {
		t.Fatalf("summary without rejections: %q", got)
	}
}

func TestCheckEndpoint(t *testing.T) {
	for _, ok := range []string{"http://127.0.0.1:8470", "https://kvm.example.com", "127.0.0.1:8470", "http://h:1/prefix"} {
		if err := checkEndpoint(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"ftp://h:1", "http://", "http://h:1/?x=1", "http://h:1/#f"} {
		if err := checkEndpoint(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// sameAttributes decides whether a Read writes the state: every field, in
// the embedded structs too, must count.
func TestSameAttributesComparesEveryField(t *testing.T) {
	vm := api.VM{ID: "vm-1", Name: "a", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64, Host: "h1",
		ObservedState: api.StateRunning, Labels: map[string]string{"k": "v"}, UserDataSHA256: "ab", Hostname: "a",
		SSHAuthorizedKeys: []string{"ssh-ed25519 AAAA"}, CreatedAt: time.Unix(1700000000, 0)}
	var base vmModel
	base.fromAPI(vm, observedPowerState(vm))
	base.setNICs(vm, false)
	base.UserData = types.StringValue("#cloud-config")
	base.WaitFor = types.StringValue(waitForRunning)
	same := base
	if !sameAttributes(base, same) {
		t.Fatal("a copy of a model is not the same as the model")
	}
	changes := map[string]func(m *vmModel){
		"power_state (vmAttributes)": func(m *vmModel) { m.PowerState = types.StringValue(api.PowerStopped) },
		"labels (vmAttributes)":      func(m *vmModel) { m.Labels = labelsValue(map[string]string{"k": "w"}) },
		"user_data_sha256":           func(m *vmModel) { m.UserDataSHA256 = types.StringNull() },
		"ssh_authorized_keys":        func(m *vmModel) { m.SSHAuthorizedKeys = stringList([]string{"ssh-ed25519 BBBB"}) },
		"wait_for (guestModel)":      func(m *vmModel) { m.WaitFor = types.StringNull() },
		"user_data (guestModel)":     func(m *vmModel) { m.UserData = types.StringValue("#!/bin/sh") },
		"network_interface": func(m *vmModel) {
			m.NetworkInterfaces = types.ListNull(m.NetworkInterfaces.ElementType(context.Background()))
		},
		"volume_attachment": func(m *vmModel) {
			m.VolumeAttachments = volumeAttachmentsValue([]api.VMVolume{{VolumeID: "vol-1"}})
		},
	}
	for what, change := range changes {
		m := base
		change(&m)
		if sameAttributes(base, m) {
			t.Errorf("a model whose %s changed is the same as before", what)
		}
	}
	// A score read from state may carry more precision than the float64 the
	// API gave (Terraform sends such a number as a decimal string): the
	// same float64 is the same score.
	precise, _, err := big.ParseFloat("1.04773", 10, 512, big.ToNearestEven)
	if err != nil {
		t.Fatal(err)
	}
	score, err := types.Float64Type.ValueFromTerraform(context.Background(), tftypes.NewValue(tftypes.Number, precise))
	if err != nil {
		t.Fatal(err)
	}
	fromState, fromAPI := base, base
	fromState.PlacementScore = score.(types.Float64)
	if fromState.PlacementScore.Equal(types.Float64Value(1.04773)) {
		t.Fatal("the precise score is Equal to its float64: the case below tests nothing")
	}
	fromAPI.PlacementScore = types.Float64Value(1.04773)
	if !sameAttributes(fromState, fromAPI) {
		t.Error("the same placement score is not the same")
	}
	fromAPI.PlacementScore = types.Float64Value(1.04774)
	if sameAttributes(fromState, fromAPI) {
		t.Error("a changed placement score is the same")
	}
	if sameAttributes(base, struct{ ID types.String }{base.ID}) {
		t.Error("models of different types are the same")
	}
}

func TestRawStringReadsTopLevelStrings(t *testing.T) {
	typ := tftypes.Object{AttributeTypes: map[string]tftypes.Type{"a": tftypes.String, "b": tftypes.String, "c": tftypes.String, "n": tftypes.Number}}
	obj := tftypes.NewValue(typ, map[string]tftypes.Value{
		"a": tftypes.NewValue(tftypes.String, "x"),
		"b": tftypes.NewValue(tftypes.String, nil),
		"c": tftypes.NewValue(tftypes.String, tftypes.UnknownValue),
		"n": tftypes.NewValue(tftypes.Number, 1),
	})
	for name, want := range map[string]types.String{"a": types.StringValue("x"), "b": types.StringNull(), "c": types.StringUnknown()} {
		got, err := rawString(obj, name)
		if err != nil || !got.Equal(want) {
			t.Errorf("rawString(%s) = %v, %v; want %v", name, got, err, want)
		}
	}
	for _, name := range []string{"n", "missing"} {
		if got, err := rawString(obj, name); err == nil {
			t.Errorf("rawString(%s) = %v, want an error", name, got)
		}
	}
	if got, err := rawString(tftypes.NewValue(typ, nil), "a"); err == nil {
		t.Errorf("rawString of a null object = %v, want an error", got)
	}
}

// A placement score in state is a number Terraform holds exactly: the
// decimal it writes, read back at Terraform's 512 bits, is a float64 (so it
// crosses the plugin protocol as one, not as a decimal string), within half
// a step of the control API's score.
func TestScoreValueIsExactInTerraform(t *testing.T) {
	for _, score := range []float64{0, 1, 1.055408970976253, 1.07853, 11.04258, 30.84686, 99.99, 1e-9, 1234.5678} {
		v := scoreValue(score).ValueFloat64()
		if math.Abs(v-score) > scoreStep/2 {
			t.Errorf("score %v reported as %v: more than half a step off", score, v)
		}
		// What Terraform writes into the state file, and reads back.
		text := big.NewFloat(v).Text('f', -1)
		back, _, err := big.ParseFloat(text, 10, 512, big.ToNearestEven)
		if err != nil {
			t.Fatal(err)
		}
		if f, acc := back.Float64(); acc != big.Exact || f != v {
			t.Errorf("score %v reported as %s: read back at 512 bits it is not the float64 %v (%v)", score, text, v, acc)
		}
	}
	// The raw score is what the rounding is for.
	raw, _, _ := big.ParseFloat(big.NewFloat(1.055408970976253).Text('f', -1), 10, 512, big.ToNearestEven)
	if _, acc := raw.Float64(); acc == big.Exact {
		t.Fatal("an unrounded score reads back exact: the test no longer shows what the rounding is for")
	}
}
