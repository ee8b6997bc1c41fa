package provider

import (
	"context"
	"regexp"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	dsschema "github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	rsschema "github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// constraintsAttrTypes is the object type of a constraints block.
var constraintsAttrTypes = map[string]attr.Type{
	"host_labels":    types.MapType{ElemType: types.StringType},
	"group":          types.StringType,
	"spread_by":      types.StringType,
	"max_per_domain": types.Int64Type,
}

// spreadByPattern is what the control API accepts for spread_by.
var spreadByPattern = regexp.MustCompile(`^(host|label:[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?)$`)

const (
	descHostLabels = "Labels the host must carry, every pair matching exactly (a hard filter). Hosts without them are " +
		"rejected with the reason `labels`."
	descGroup = "Name shared by VMs that belong together (for example the replicas of one service). The group's VMs " +
		"are spread over failure domains (`spread_by`): a domain with fewer of them scores better, and " +
		"`max_per_domain` caps them."
	descSpreadBy = "The failure domain of the group: `host` (the default when `group` is set) or `label:<key>`, the " +
		"value of that host label (for example `label:rack`). A host without that label cannot take a VM of the " +
		"group and is rejected with the reason `labels`."
	descMaxPerDomain = "Hard cap of the group's VMs per domain; `0` (the default) is no cap, `1` is strict " +
		"anti-affinity. Hosts whose domain is full are rejected with the reason `group_cap`. Several control API " +
		"replicas never exceed it: the database decides."
)

// constraintsResourceBlock is the constraints block of kvm_vm and
// kvm_fork. needGroup makes spread_by and max_per_domain require group
// (a fork's children form a group of their own without one).
func constraintsResourceBlock(description string, needGroup bool) rsschema.SingleNestedBlock {
	spread := []validator.String{stringvalidator.RegexMatches(spreadByPattern, "must be `host` or `label:<key>`")}
	maxPer := []validator.Int64{int64validator.Between(0, 100000)}
	if needGroup {
		group := path.MatchRelative().AtParent().AtName("group")
		spread = append(spread, stringvalidator.AlsoRequires(group))
		maxPer = append(maxPer, int64validator.AlsoRequires(group))
	}
	return rsschema.SingleNestedBlock{
		MarkdownDescription: description,
		Attributes: map[string]rsschema.Attribute{
			"host_labels": rsschema.MapAttribute{MarkdownDescription: descHostLabels, ElementType: types.StringType, Optional: true},
			"group": rsschema.StringAttribute{MarkdownDescription: descGroup, Optional: true,
				Validators: []validator.String{stringvalidator.LengthBetween(1, 63)}},
			"spread_by":      rsschema.StringAttribute{MarkdownDescription: descSpreadBy, Optional: true, Validators: spread},
			"max_per_domain": rsschema.Int64Attribute{MarkdownDescription: descMaxPerDomain, Optional: true, Validators: maxPer},
		},
	}
}

// constraintsDataBlock is the constraints block of kvm_placement.
func constraintsDataBlock() dsschema.SingleNestedBlock {
	group := path.MatchRelative().AtParent().AtName("group")
	return dsschema.SingleNestedBlock{
		MarkdownDescription: "Placement constraints, applied as a `kvm_vm` with the same block would have them applied.",
		Attributes: map[string]dsschema.Attribute{
			"host_labels": dsschema.MapAttribute{MarkdownDescription: descHostLabels, ElementType: types.StringType, Optional: true},
			"group": dsschema.StringAttribute{MarkdownDescription: descGroup + " The dry run counts the group's VMs that exist now.",
				Optional: true, Validators: []validator.String{stringvalidator.LengthBetween(1, 63)}},
			"spread_by": dsschema.StringAttribute{MarkdownDescription: descSpreadBy, Optional: true, Validators: []validator.String{
				stringvalidator.RegexMatches(spreadByPattern, "must be `host` or `label:<key>`"), stringvalidator.AlsoRequires(group)}},
			"max_per_domain": dsschema.Int64Attribute{MarkdownDescription: descMaxPerDomain, Optional: true,
				Validators: []validator.Int64{int64validator.Between(0, 100000), int64validator.AlsoRequires(group)}},
		},
	}
}

// constraintsComputedAttribute is constraints as the kvm_vm data source
// reports them.
func constraintsComputedAttribute() dsschema.SingleNestedAttribute {
	return dsschema.SingleNestedAttribute{
		MarkdownDescription: "The VM's placement constraints; null when it has none.",
		Computed:            true,
		Attributes: map[string]dsschema.Attribute{
			"host_labels":    dsschema.MapAttribute{MarkdownDescription: descHostLabels, ElementType: types.StringType, Computed: true},
			"group":          dsschema.StringAttribute{MarkdownDescription: descGroup, Computed: true},
			"spread_by":      dsschema.StringAttribute{MarkdownDescription: descSpreadBy, Computed: true},
			"max_per_domain": dsschema.Int64Attribute{MarkdownDescription: descMaxPerDomain, Computed: true},
		},
	}
}

type constraintsData struct {
	HostLabels   types.Map    `tfsdk:"host_labels"`
	Group        types.String `tfsdk:"group"`
	SpreadBy     types.String `tfsdk:"spread_by"`
	MaxPerDomain types.Int64  `tfsdk:"max_per_domain"`
}

// constraintsFromObject reads a constraints block; nil when it is absent.
func constraintsFromObject(ctx context.Context, v types.Object) (*api.Constraints, diag.Diagnostics) {
	if v.IsNull() || v.IsUnknown() {
		return nil, nil
	}
	var d constraintsData
	diags := v.As(ctx, &d, basetypes.ObjectAsOptions{})
	if diags.HasError() {
		return nil, diags
	}
	c := &api.Constraints{Group: d.Group.ValueString(), SpreadBy: d.SpreadBy.ValueString(), MaxPerDomain: int(d.MaxPerDomain.ValueInt64())}
	if !d.HostLabels.IsNull() && !d.HostLabels.IsUnknown() {
		diags.Append(d.HostLabels.ElementsAs(ctx, &c.HostLabels, false)...)
	}
	return c, diags
}

// constraintsObject is the state of a constraints block as the API
// reports it. The API leaves out what is empty, so prior (the plan or the
// state before) decides between an absent and an empty block or map, and
// the same configuration never shows a diff.
func constraintsObject(c *api.Constraints, prior types.Object) types.Object {
	priorAttrs := prior.Attributes()
	if c == nil {
		if !prior.IsNull() && !prior.IsUnknown() && constraintsEmpty(priorAttrs) {
			return prior
		}
		return types.ObjectNull(constraintsAttrTypes)
	}
	labels := types.MapNull(types.StringType)
	if len(c.HostLabels) > 0 {
		labels = labelsValue(c.HostLabels)
	} else if m, ok := priorAttrs["host_labels"].(types.Map); ok && !m.IsNull() && !m.IsUnknown() && len(m.Elements()) == 0 {
		labels = m
	}
	maxPer := types.Int64Null()
	if c.MaxPerDomain != 0 {
		maxPer = types.Int64Value(int64(c.MaxPerDomain))
	} else if v, ok := priorAttrs["max_per_domain"].(types.Int64); ok && !v.IsNull() && !v.IsUnknown() && v.ValueInt64() == 0 {
		maxPer = v
	}
	return types.ObjectValueMust(constraintsAttrTypes, map[string]attr.Value{
		"host_labels":    labels,
		"group":          optionalString(c.Group),
		"spread_by":      optionalString(c.SpreadBy),
		"max_per_domain": maxPer,
	})
}

// constraintsEmpty says whether a block sets nothing that the API keeps.
func constraintsEmpty(attrs map[string]attr.Value) bool {
	for _, v := range attrs {
		switch x := v.(type) {
		case types.Map:
			if !x.IsNull() && len(x.Elements()) > 0 {
				return false
			}
		case types.String:
			if !x.IsNull() && x.ValueString() != "" {
				return false
			}
		case types.Int64:
			if !x.IsNull() && x.ValueInt64() != 0 {
				return false
			}
		}
	}
	return true
}
