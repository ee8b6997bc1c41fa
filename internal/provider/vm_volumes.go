package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
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
// again with the same volumes; the kvm_volume does not change. Adding or
// removing a block later is an in-place update: the control API attaches
// and detaches hot (POST and DELETE /v1/vms/{id}/volumes), so a running
// guest keeps running and sees the disk come or go.

// volumeAttachmentModel is one volume_attachment block.
type volumeAttachmentModel struct {
	Volume   types.String `tfsdk:"volume"`
	ReadOnly types.Bool   `tfsdk:"read_only"`
}

var volumeAttachmentTypes = map[string]attr.Type{"volume": types.StringType, "read_only": types.BoolType}

// volumeAttachmentBlock is kvm_vm's volume_attachment block: attached
// before the first boot at create, hot later (an in-place update).
func volumeAttachmentBlock() schema.ListNestedBlock {
	return schema.ListNestedBlock{
		MarkdownDescription: "A volume (`kvm_volume`) attached to the VM; the guest sees it at " +
			"`/dev/disk/by-id/virtio-<serial>` (the volume's `device`). At create the volumes are attached before the " +
			"guest boots and the VM is placed on their host, so every volume of a VM must be on one host. Adding or " +
			"removing a block later is an in-place update: the volume is attached to or detached from the running " +
			"guest (hot; a stopped VM gets it at its next start), and the VM keeps its id. A volume to add must be on " +
			"the VM's host (move it there first). Changing `read_only` detaches and attaches it again. A refresh " +
			"shows the volumes the VM has: one detached behind Terraform's back shows as a change, and apply " +
			"attaches it again. A replace (for another reason) destroys the old VM first, which detaches its " +
			"volumes, and the new VM attaches them before it boots: do not set `create_before_destroy` on a VM with " +
			"a read-write volume, its new VM could not attach it. At most 8 volumes per VM.",
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
// an import, whose state has none yet. Otherwise Read keeps the blocks as
// configured where the VM has them (readVolumeAttachments).
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

// volumeIDResolver turns a block's volume (an id, or a name in the
// project) into the volume's id.
type volumeIDResolver func(ctx context.Context, ref string) (string, error)

// apiVolumeIDs resolves with the control API: an id is itself, a name is
// read once.
func apiVolumeIDs(c *client.Client) volumeIDResolver {
	names := map[string]string{}
	return func(ctx context.Context, ref string) (string, error) {
		if _, err := uuid.Parse(ref); err == nil {
			return ref, nil
		}
		if id, ok := names[ref]; ok {
			return id, nil
		}
		v, err := c.GetVolume(ctx, ref)
		if err != nil {
			return "", err
		}
		names[ref] = v.ID
		return v.ID, nil
	}
}

// attachedVolumes are the VM's attached volumes by id: read_only. An
// attach or detach the control API has not finished is not attached.
func attachedVolumes(vm api.VM) map[string]bool {
	out := map[string]bool{}
	for _, v := range vm.Volumes {
		if v.State == "" || v.State == api.AttachmentAttached {
			out[v.VolumeID] = v.ReadOnly
		}
	}
	return out
}

// readVolumeAttachments is the blocks Read records: each prior block the
// VM still has (as configured: a name stays a name), with the read_only
// the VM has it with; then, by id, the volumes the VM has that no block
// names. So a volume detached or attached behind Terraform's back shows
// in the next plan, and apply puts it back as configured.
func readVolumeAttachments(ctx context.Context, prior types.List, vm api.VM, resolve volumeIDResolver) (types.List, diag.Diagnostics) {
	blocks, diags := volumesOf(ctx, prior)
	if diags.HasError() {
		return prior, diags
	}
	have := attachedVolumes(vm)
	seen := map[string]bool{}
	var out []api.VMVolume
	for _, b := range blocks {
		id, err := resolve(ctx, b.Volume)
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				continue // the volume is gone: so is its attachment
			}
			diags.AddError(summaryReadVM, apiErrorDetail(fmt.Sprintf("reading volume %q of VM %s", b.Volume, vm.ID), err))
			return prior, diags
		}
		ro, ok := have[id]
		if !ok || seen[id] {
			continue
		}
		seen[id] = true
		// volumeAttachmentsValue records VolumeID: here the ref as configured.
		out = append(out, api.VMVolume{VolumeID: b.Volume, ReadOnly: ro})
	}
	for _, v := range vm.Volumes {
		if ro, ok := have[v.VolumeID]; ok && !seen[v.VolumeID] {
			seen[v.VolumeID] = true
			out = append(out, api.VMVolume{VolumeID: v.VolumeID, ReadOnly: ro})
		}
	}
	if len(out) == 0 && !prior.IsNull() && len(prior.Elements()) == 0 {
		return prior, diags // none, as the state had it
	}
	return volumeAttachmentsValue(out), diags
}

// volumeChange is one step of an update of the blocks.
type volumeChange struct {
	ref      string // as configured
	id       string
	readOnly bool
}

// diffVolumeAttachments compares the blocks in state with the planned
// ones by volume id: detach what is gone or changes read_only, attach
// what is new or changes read_only.
func diffVolumeAttachments(ctx context.Context, state, plan types.List, resolve volumeIDResolver) (detach, attach []volumeChange, diags diag.Diagnostics) {
	before, d := volumesOf(ctx, state)
	diags.Append(d...)
	after, d := volumesOf(ctx, plan)
	diags.Append(d...)
	if diags.HasError() {
		return nil, nil, diags
	}
	index := func(vols []api.VMVolume) (map[string]volumeChange, []string, bool) {
		out := map[string]volumeChange{}
		var order []string
		for i, v := range vols {
			id, err := resolve(ctx, v.Volume)
			if err != nil {
				diags.AddAttributeError(path.Root("volume_attachment").AtListIndex(i).AtName("volume"), summaryUpdateVM,
					apiErrorDetail(fmt.Sprintf("reading volume %q", v.Volume), err))
				return nil, nil, false
			}
			if _, dup := out[id]; !dup {
				order = append(order, id)
			}
			out[id] = volumeChange{ref: v.Volume, id: id, readOnly: v.ReadOnly}
		}
		return out, order, true
	}
	was, wasOrder, ok := index(before)
	if !ok {
		return nil, nil, diags
	}
	will, willOrder, ok := index(after)
	if !ok {
		return nil, nil, diags
	}
	for _, id := range wasOrder {
		if w, ok := will[id]; !ok || w.readOnly != was[id].readOnly {
			detach = append(detach, was[id])
		}
	}
	for _, id := range willOrder {
		if w, ok := was[id]; !ok || w.readOnly != will[id].readOnly {
			attach = append(attach, will[id])
		}
	}
	return detach, attach, diags
}

// updateVolumeAttachments detaches, then attaches, what the plan changes
// of the VM's volume_attachment blocks, and returns the VM as the last
// call left it (vm when nothing changed). Detaches go first, so a volume
// that changes read_only, or an attach that needs a slot a removed volume
// frees, works in one apply.
func (r *vmResource) updateVolumeAttachments(ctx context.Context, vm api.VM, state, plan types.List, diags *diag.Diagnostics) api.VM {
	detach, attach, d := diffVolumeAttachments(ctx, state, plan, apiVolumeIDs(r.data.client))
	diags.Append(d...)
	if diags.HasError() {
		return vm
	}
	for _, c := range detach {
		tflog.Info(ctx, "detaching a volume from the VM", map[string]any{"id": vm.ID, "volume": c.id})
		err := r.data.client.DetachVolume(ctx, vm.ID, c.id)
		r.data.wrote()
		if err != nil && !errors.Is(err, client.ErrNotFound) {
			addAPIError(diags, summaryUpdateVM, fmt.Sprintf("detaching volume %q from VM %s (%q); run terraform apply again", c.ref, vm.ID, vm.Name), err)
			return vm
		}
	}
	for _, c := range attach {
		tflog.Info(ctx, "attaching a volume to the VM", map[string]any{"id": vm.ID, "volume": c.id, "read_only": c.readOnly})
		got, err := r.data.client.AttachVolume(ctx, vm.ID, api.VMVolumeAttach{Volume: c.id, ReadOnly: c.readOnly})
		r.data.wrote()
		if err != nil {
			addAPIError(diags, summaryUpdateVM, fmt.Sprintf("attaching volume %q to VM %s (%q) on host %s; the volumes before it in the "+
				"plan are changed already, run terraform apply again once the cause is fixed", c.ref, vm.ID, vm.Name, vm.Host), err)
			return vm
		}
		vm = got
	}
	return vm
}
