package provider

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// readyFork is the state of a ready fork with one child.
func readyFork() forkModel {
	return forkModel{
		forkAttributes: forkAttributes{
			ID:          types.StringValue("f1"),
			SourceVMID:  types.StringValue("vm1"),
			ChildCount:  types.Int64Value(1),
			PauseSource: types.BoolValue(false),
			Placement:   types.StringValue(api.PlacementColocate),
			SnapshotID:  types.StringValue("f1"),
			Phase:       types.StringValue(api.ForkReady),
			Children: forkChildren([]api.VM{
				{ID: "c0", Name: "f1-0", Host: "h1", ObservedState: api.StateRunning},
			}),
			CreatedAt:   timestamp(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)),
			Constraints: types.ObjectNull(constraintsAttrTypes),
		},
		Timeouts: timeouts.Value{Object: types.ObjectNull(map[string]attr.Type{
			"create": types.StringType, "update": types.StringType, "delete": types.StringType,
		})},
	}
}

func forkSchema(t *testing.T) schema.Schema {
	t.Helper()
	var resp resource.SchemaResponse
	NewForkResource().Schema(context.Background(), resource.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() {
		t.Fatalf("schema: %v", resp.Diagnostics)
	}
	return resp.Schema
}

// modifyPlan runs the resource's ModifyPlan on an update from state to plan.
func modifyPlan(t *testing.T, state, plan forkModel) (tfsdk.Plan, diag.Diagnostics) {
	t.Helper()
	ctx := context.Background()
	sch := forkSchema(t)
	null := tftypes.NewValue(sch.Type().TerraformType(ctx), nil)
	st := tfsdk.State{Schema: sch, Raw: null}
	pl := tfsdk.Plan{Schema: sch, Raw: null}
	if d := st.Set(ctx, &state); d.HasError() {
		t.Fatalf("state: %v", d)
	}
	if d := pl.Set(ctx, &plan); d.HasError() {
		t.Fatalf("plan: %v", d)
	}
	resp := resource.ModifyPlanResponse{Plan: pl}
	NewForkResource().(*forkResource).ModifyPlan(ctx, resource.ModifyPlanRequest{State: st, Plan: pl}, &resp)
	return resp.Plan, resp.Diagnostics
}

func planPhase(t *testing.T, p tfsdk.Plan) types.String {
	t.Helper()
	var phase types.String
	if d := p.GetAttribute(context.Background(), path.Root("phase"), &phase); d.HasError() {
		t.Fatalf("phase: %v", d)
	}
	return phase
}

func TestForkModifyPlanWarnsWhenPauseSourceChangesInPlace(t *testing.T) {
	state, plan := readyFork(), readyFork()
	plan.PauseSource = types.BoolValue(true)
	got, diags := modifyPlan(t, state, plan)
	if diags.HasError() || diags.WarningsCount() != 1 {
		t.Fatalf("want exactly one warning, got %v", diags)
	}
	w := diags.Warnings()[0]
	if w.Summary() != summaryForkPointTaken || !strings.Contains(w.Detail(), "neither pauses nor resumes source VM vm1") {
		t.Fatalf("warning %q: %q does not say that the source is left as it is", w.Summary(), w.Detail())
	}
	if p := planPhase(t, got); !p.Equal(types.StringValue(api.ForkReady)) {
		t.Fatalf("a pause_source change on a ready fork planned phase %s, want it kept", p)
	}
}

func TestForkModifyPlanNoWarningWhenReplaced(t *testing.T) {
	state, plan := readyFork(), readyFork()
	plan.PauseSource = types.BoolValue(true)
	plan.Placement = types.StringValue(api.PlacementSpread) // replaces the fork: the new value acts
	if _, diags := modifyPlan(t, state, plan); len(diags) != 0 {
		t.Fatalf("a replaced fork drew diagnostics: %v", diags)
	}
}

func TestForkModifyPlanResumesAForkThatIsNotReady(t *testing.T) {
	for _, phase := range []string{api.ForkFailed, api.ForkRetrying, api.ForkSpawning, api.ForkPending} {
		state := readyFork()
		state.Phase = types.StringValue(phase)
		got, diags := modifyPlan(t, state, state)
		if len(diags) != 0 {
			t.Fatalf("phase %s: diagnostics %v", phase, diags)
		}
		if p := planPhase(t, got); !p.IsUnknown() {
			t.Fatalf("phase %s: planned phase %s, want unknown so that apply resumes the pass", phase, p)
		}
	}
	state := readyFork()
	got, diags := modifyPlan(t, state, state)
	if len(diags) != 0 {
		t.Fatalf("ready fork: diagnostics %v", diags)
	}
	want := tfsdk.Plan{Schema: got.Schema, Raw: got.Raw.Copy()}
	if d := want.Set(context.Background(), &state); d.HasError() {
		t.Fatalf("plan: %v", d)
	}
	if !got.Raw.Equal(want.Raw) {
		t.Fatalf("a ready fork with no change got a modified plan: %v", got.Raw)
	}
}

func TestForkChildrenInSlotOrder(t *testing.T) {
	l := forkChildren([]api.VM{{ID: "c10", Name: "f-10"}, {ID: "c2", Name: "f-2"}, {ID: "c0", Name: "f-0"}})
	var ids []string
	for _, e := range l.Elements() {
		ids = append(ids, e.(types.Object).Attributes()["id"].(types.String).ValueString())
	}
	if strings.Join(ids, ",") != "c0,c2,c10" {
		t.Fatalf("children in order %v, want slots 0, 2, 10", ids)
	}
}
