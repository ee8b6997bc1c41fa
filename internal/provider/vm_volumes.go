package provider

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/listplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// Why blocks on kvm_vm and not a kvm_volume_attachment resource: the
// control API attaches a VM's volumes in its create (the same transaction
// as its reservation, and the agent attaches them before the guest boots,
// so fstab and cloud-init mounts find the disk at first boot), and it
// places the VM on the volumes' host. A separate resource would attach
// after the VM exists (a guest booted without its data, placed without
// knowing its volume's host) and would itself be replaced with every
// replace of its VM: two resources changing where one does. With blocks,
// a VM replaced for new user_data is destroyed (which detaches) and made
// again with the same volumes; the kvm_volume does not change.

// volumeAttachmentModel is one volume_attachment block.
type volumeAttachmentModel struct {
	Volume   types.String `tfsdk:"volume"`
	ReadOnly types.Bool   `tfsdk:"read_only"`
}

var volumeAttachmentTypes = map[string]attr.Type{"volume": types.StringType, "read_only": types.BoolType}

// volumeAttachmentBlock is kvm_vm's volume_attachment block: fixed at
// create, a change replaces the VM (volumes are attached before boot).
func volumeAttachmentBlock() schema.ListNestedBlock {
	return schema.ListNestedBlock{
		MarkdownDescription: "A volume (`kvm_volume`) attached to the VM before it boots; the guest sees it at " +
			"`/dev/disk/by-id/virtio-<serial>` (the volume's `device`). The VM is placed on the volumes' host, so " +
			"every volume of a VM must be on one host. Adding, removing or changing a block replaces the VM; the " +
			"volumes and their data stay. A replace destroys the old VM first (which detaches its volumes): do not " +
			"set `create_before_destroy` on a VM with a read-write volume, its new VM could not attach it.",
		PlanModifiers: []planmodifier.List{listplanmodifier.RequiresReplace()},
		NestedObject: schema.NestedBlockObject{
			Attributes: map[string]schema.Attribute{
				"volume": schema.StringAttribute{
					MarkdownDescription: "The volume's `id` (or its name in the project).",
					Required:            true,
				},
				"read_only": schema.BoolAttribute{
					MarkdownDescription: "Attach it read-only. A volume attached read-write belongs to one VM; " +
						"read-only, several VMs may share it. Default `false`.",
					Optional: true,
					Computed: true,
					Default:  booldefault.StaticBool(false),
				},
			},
		},
	}
}

// volumesOf is the create body's volumes from the blocks.
func volumesOf(ctx context.Context, v types.List) ([]api.VMVolume, diag.Diagnostics) {
	if v.IsNull() || v.IsUnknown() {
		return nil, nil
	}
	var blocks []volumeAttachmentModel
	diags := v.ElementsAs(ctx, &blocks, false)
	out := make([]api.VMVolume, 0, len(blocks))
	for _, b := range blocks {
		out = append(out, api.VMVolume{Volume: b.Volume.ValueString(), ReadOnly: b.ReadOnly.ValueBool()})
	}
	return out, diags
}

// volumeAttachmentsValue is the blocks of a VM read back (by volume id): for
// an import, whose state has none yet. Otherwise the state keeps the
// blocks as configured (a volume named by name reads back as its id).
func volumeAttachmentsValue(vols []api.VMVolume) types.List {
	objType := types.ObjectType{AttrTypes: volumeAttachmentTypes}
	if len(vols) == 0 {
		return types.ListNull(objType)
	}
	elems := make([]attr.Value, 0, len(vols))
	for _, v := range vols {
		elems = append(elems, types.ObjectValueMust(volumeAttachmentTypes, map[string]attr.Value{
			"volume": types.StringValue(v.VolumeID), "read_only": types.BoolValue(v.ReadOnly)}))
	}
	return types.ListValueMust(objType, elems)
}
