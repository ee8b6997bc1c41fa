package provider

import (
	"context"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

func placedVM(c *api.Constraints) vmModel {
	var m vmModel
	m.Constraints = types.ObjectNull(constraintsAttrTypes)
	m.fromAPI(api.VM{ID: "vm1", Name: "db-0", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: "h2",
		PowerState: api.PowerRunning, ObservedState: api.StateRunning, Constraints: c}, api.PowerRunning)
	m.setNICs(api.VM{}, false) // no network_interface blocks: the implied default NIC
	m.Timeouts = timeouts.Value{Object: types.ObjectNull(map[string]attr.Type{
		"create": types.StringType, "update": types.StringType, "delete": types.StringType,
	})}
	return m
}

func modifyVMPlan(t *testing.T, state, plan vmModel) diag.Diagnostics {
	t.Helper()
	ctx := context.Background()
	var sr resource.SchemaResponse
	NewVMResource().Schema(ctx, resource.SchemaRequest{}, &sr)
	null := tftypes.NewValue(sr.Schema.Type().TerraformType(ctx), nil)
	st := tfsdk.State{Schema: sr.Schema, Raw: null}
	pl := tfsdk.Plan{Schema: sr.Schema, Raw: null}
	if d := st.Set(ctx, &state); d.HasError() {
		t.Fatalf("state: %v", d)
	}
	if d := pl.Set(ctx, &plan); d.HasError() {
		t.Fatalf("plan: %v", d)
	}
	resp := resource.ModifyPlanResponse{Plan: pl}
	cfg := tfsdk.Config{Schema: sr.Schema, Raw: pl.Raw}
	NewVMResource().(*vmResource).ModifyPlan(ctx, resource.ModifyPlanRequest{State: st, Plan: pl, Config: cfg}, &resp)
	return resp.Diagnostics
}

func TestVMModifyPlanNotesThatConstraintsMoveNothing(t *testing.T) {
	state := placedVM(&api.Constraints{Group: "db", MaxPerDomain: 1})
	plan := placedVM(&api.Constraints{Group: "db", MaxPerDomain: 2})
	diags := modifyVMPlan(t, state, plan)
	if diags.HasError() || diags.WarningsCount() != 1 {
		t.Fatalf("want exactly one warning, got %v", diags)
	}
	w := diags.Warnings()[0]
	if w.Summary() != summaryConstraintsStored || !strings.Contains(w.Detail(), `VM vm1 ("db-0") stays on host h2`) ||
		!strings.Contains(w.Detail(), "-replace") {
		t.Errorf("warning %q: %q must say the VM stays and how to place it again", w.Summary(), w.Detail())
	}
	if d := modifyVMPlan(t, state, state); len(d) != 0 {
		t.Errorf("no change drew diagnostics: %v", d)
	}
}

// The API leaves empty parts out; the prior value decides how they read
// back, so `constraints {}` or `host_labels = {}` never show a diff.
func TestConstraintsObjectKeepsEmptyConfigShapes(t *testing.T) {
	empty := constraintsObject(&api.Constraints{}, types.ObjectNull(constraintsAttrTypes))
	if empty.IsNull() {
		t.Fatal("an API answer with constraints must not read as null")
	}
	block := types.ObjectValueMust(constraintsAttrTypes, map[string]attr.Value{
		"host_labels": types.MapValueMust(types.StringType, map[string]attr.Value{}), "group": types.StringNull(),
		"spread_by": types.StringNull(), "max_per_domain": types.Int64Value(0),
	})
	if got := constraintsObject(nil, block); !got.Equal(block) {
		t.Errorf("empty block read back as %v, want it kept", got)
	}
	if got := constraintsObject(nil, types.ObjectNull(constraintsAttrTypes)); !got.IsNull() {
		t.Errorf("no block read back as %v, want null", got)
	}
	set := constraintsObject(&api.Constraints{Group: "g"}, block)
	if m := set.Attributes()["host_labels"].(types.Map); m.IsNull() || len(m.Elements()) != 0 {
		t.Errorf("host_labels = {} read back as %v", m)
	}
}
