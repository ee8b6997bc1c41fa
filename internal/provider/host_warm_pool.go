package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	dschema "github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// warmPoolAttrTypes are the attributes of one warm_pool entry of kvm_host;
// the data sources add the computed ready count.
var warmPoolAttrTypes = map[string]attr.Type{
	"image":      types.StringType,
	"vcpus":      types.Int64Type,
	"memory_mib": types.Int64Type,
	"disk_mib":   types.Int64Type,
	"size":       types.Int64Type,
}

var warmPoolDataAttrTypes = map[string]attr.Type{
	"image":      types.StringType,
	"vcpus":      types.Int64Type,
	"memory_mib": types.Int64Type,
	"disk_mib":   types.Int64Type,
	"size":       types.Int64Type,
	"ready":      types.Int64Type,
}

const warmPoolDescription = "Warm pool of the host: per image and VM shape, how many pre-booted, paused VMs the " +
	"agent keeps ready, so that a `kvm_vm` of exactly that image, `vcpus`, `memory_mib` and `disk_mib` starts in " +
	"milliseconds (its `started_from` is then `warm`). The scheduler prefers a host with a matching warm VM when its " +
	"score is within 10% of the best host's."

// warmPoolResourceAttribute is kvm_host's warm_pool: optional, changed in
// place; leaving it out empties the host's warm pool.
func warmPoolResourceAttribute() schema.ListNestedAttribute {
	return schema.ListNestedAttribute{
		MarkdownDescription: warmPoolDescription + " Leaving it out keeps no warm VMs. Each image and " +
			"shape may appear once.",
		Optional:   true,
		Validators: []validator.List{listvalidator.SizeAtLeast(1)},
		NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
			"image": schema.StringAttribute{MarkdownDescription: "Guest image of the warm VMs.", Required: true,
				Validators: []validator.String{stringvalidator.LengthAtLeast(1)}},
			"vcpus": schema.Int64Attribute{MarkdownDescription: "Virtual CPUs of the warm VMs.", Required: true,
				Validators: []validator.Int64{int64validator.AtLeast(1)}},
			"memory_mib": schema.Int64Attribute{MarkdownDescription: "Memory of the warm VMs in MiB.", Required: true,
				Validators: []validator.Int64{int64validator.AtLeast(1)}},
			"disk_mib": schema.Int64Attribute{MarkdownDescription: "Disk of the warm VMs in MiB.", Required: true,
				Validators: []validator.Int64{int64validator.AtLeast(1)}},
			"size": schema.Int64Attribute{MarkdownDescription: "How many warm VMs of this image and shape to keep ready.", Required: true,
				Validators: []validator.Int64{int64validator.Between(0, 1000)}},
		}},
	}
}

// warmPoolDataAttribute is warm_pool in the kvm_host and kvm_hosts data
// sources, with the ready counts.
func warmPoolDataAttribute() dschema.ListNestedAttribute {
	c := func(d string) dschema.Int64Attribute {
		return dschema.Int64Attribute{MarkdownDescription: d, Computed: true}
	}
	return dschema.ListNestedAttribute{
		MarkdownDescription: warmPoolDescription,
		Computed:            true,
		NestedObject: dschema.NestedAttributeObject{Attributes: map[string]dschema.Attribute{
			"image":      dschema.StringAttribute{MarkdownDescription: "Guest image of the warm VMs.", Computed: true},
			"vcpus":      c("Virtual CPUs of the warm VMs."),
			"memory_mib": c("Memory of the warm VMs in MiB."),
			"disk_mib":   c("Disk of the warm VMs in MiB."),
			"size":       c("Target: how many warm VMs of this image and shape the agent keeps."),
			"ready":      c("How many are booted and ready now, as the host agent last reported."),
		}},
	}
}

// warmPoolValue is the resource's warm_pool from the API: null when the
// host has none, so that a configuration without warm_pool shows no diff.
func warmPoolValue(pool []api.WarmPoolTarget) types.List {
	elem := types.ObjectType{AttrTypes: warmPoolAttrTypes}
	if len(pool) == 0 {
		return types.ListNull(elem)
	}
	items := make([]attr.Value, 0, len(pool))
	for _, p := range pool {
		items = append(items, types.ObjectValueMust(warmPoolAttrTypes, map[string]attr.Value{
			"image": types.StringValue(p.Image), "vcpus": types.Int64Value(p.VCPUs),
			"memory_mib": types.Int64Value(p.MemoryMiB), "disk_mib": types.Int64Value(p.DiskMiB),
			"size": types.Int64Value(int64(p.Size)),
		}))
	}
	return types.ListValueMust(elem, items)
}

// warmPoolDataValue is the data sources' warm_pool (an empty list when none).
func warmPoolDataValue(pool []api.WarmPoolTarget) types.List {
	elem := types.ObjectType{AttrTypes: warmPoolDataAttrTypes}
	items := make([]attr.Value, 0, len(pool))
	for _, p := range pool {
		items = append(items, types.ObjectValueMust(warmPoolDataAttrTypes, map[string]attr.Value{
			"image": types.StringValue(p.Image), "vcpus": types.Int64Value(p.VCPUs),
			"memory_mib": types.Int64Value(p.MemoryMiB), "disk_mib": types.Int64Value(p.DiskMiB),
			"size": types.Int64Value(int64(p.Size)), "ready": types.Int64Value(int64(p.Ready)),
		}))
	}
	return types.ListValueMust(elem, items)
}

// warmPoolModel is one warm_pool entry of the resource.
type warmPoolModel struct {
	Image     types.String `tfsdk:"image"`
	VCPUs     types.Int64  `tfsdk:"vcpus"`
	MemoryMiB types.Int64  `tfsdk:"memory_mib"`
	DiskMiB   types.Int64  `tfsdk:"disk_mib"`
	Size      types.Int64  `tfsdk:"size"`
}

// warmPoolFromValue is the API's warm_pool from the resource's (an empty
// list when null: a PUT replaces the host's targets).
func warmPoolFromValue(ctx context.Context, v types.List) ([]api.WarmPoolTarget, error) {
	out := []api.WarmPoolTarget{}
	if v.IsNull() || v.IsUnknown() {
		return out, nil
	}
	var items []warmPoolModel
	if diags := v.ElementsAs(ctx, &items, false); diags.HasError() {
		return nil, fmt.Errorf("warm_pool: %v", diags)
	}
	for _, m := range items {
		out = append(out, api.WarmPoolTarget{Image: m.Image.ValueString(), VCPUs: m.VCPUs.ValueInt64(),
			MemoryMiB: m.MemoryMiB.ValueInt64(), DiskMiB: m.DiskMiB.ValueInt64(), Size: int(m.Size.ValueInt64())})
	}
	return out, nil
}
