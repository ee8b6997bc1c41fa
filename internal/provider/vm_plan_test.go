package provider

import (
	"context"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
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
	return modifyVMPlanResponse(t, state, plan).Diagnostics
}

func modifyVMPlanResponse(t *testing.T, state, plan vmModel) resource.ModifyPlanResponse {
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
	return resp
}

// The plan replaces a VM whose user data digest in state differs from the
// configured user data's (changed user data, either form, or drift), and
// leaves alone one whose digest matches (an import of the same user data).
func TestVMModifyPlanReplacesOnUserDataDigest(t *testing.T) {
	withDigest := func(userData string) vmModel {
		m := placedVM(nil)
		m.UserDataSHA256 = userDataDigest(userData)
		return m
	}
	configured := func(userData, wo string) vmModel {
		m := placedVM(nil)
		m.UserData, m.UserDataWO = optionalString(userData), optionalString(wo)
		return m
	}
	replaces := func(resp resource.ModifyPlanResponse) bool {
		for _, p := range resp.RequiresReplace {
			if p.Equal(path.Root("user_data_sha256")) {
				return true
			}
		}
		return false
	}
	for _, tc := range []struct {
		name            string
		state, plan     vmModel
		replace         bool
		wantPlannedHash types.String
	}{
		{"same user data", withDigest("a"), configured("a", ""), false, userDataDigest("a")},
		{"changed user data", withDigest("a"), configured("b", ""), true, userDataDigest("b")},
		{"write-only, same", withDigest("s"), configured("", "s"), false, userDataDigest("s")},
		{"write-only, changed", withDigest("s"), configured("", "t"), true, userDataDigest("t")},
		{"user data removed", withDigest("a"), configured("", ""), true, types.StringNull()},
		{"user data added", withDigest(""), configured("a", ""), true, userDataDigest("a")},
		{"none", withDigest(""), configured("", ""), false, types.StringNull()},
	} {
		resp := modifyVMPlanResponse(t, tc.state, tc.plan)
		if resp.Diagnostics.HasError() {
			t.Fatalf("%s: %v", tc.name, resp.Diagnostics)
		}
		var planned types.String
		resp.Plan.GetAttribute(context.Background(), path.Root("user_data_sha256"), &planned)
		if replaces(resp) != tc.replace || !planned.Equal(tc.wantPlannedHash) {
			t.Errorf("%s: replace %v (want %v), planned digest %v (want %v)", tc.name, replaces(resp), tc.replace,
				planned, tc.wantPlannedHash)
		}
	}
}

func TestLastLines(t *testing.T) {
	if got := lastLines("a\nb\r\nc\nd\n\n", 2); got != "c\nd" {
		t.Errorf("lastLines 2 = %q", got)
	}
	if got := lastLines("only", 30); got != "only" {
		t.Errorf("lastLines of one line = %q", got)
	}
	if got := lastLines("\x1b[0;32m  OK  \x1b[0m] Started\r\n", 30); got != "  OK  ] Started" {
		t.Errorf("lastLines keeps terminal control sequences: %q", got)
	}
	if got := lastLines("\n", 30); !strings.Contains(got, "empty") {
		t.Errorf("lastLines of nothing = %q, want it to say the console is empty", got)
	}
}

func TestParseAuthorizedKey(t *testing.T) {
	const key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq2uYfNMcVk0e9Yy1UZwSzQ3s2Jv7O3h5t7mKz3YbQn me@host"
	for _, ok := range []string{key, key + "\n", "  " + key + "\r\n"} {
		if err := parseAuthorizedKey(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "ssh-ed25519 not-base64", key + "\n" + key, "-----BEGIN OPENSSH PRIVATE KEY-----"} {
		if err := parseAuthorizedKey(bad); err == nil {
			t.Errorf("%q was accepted", bad)
		}
	}
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
