package provider

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/mapdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/objectplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ resource.Resource                = (*volumeResource)(nil)
	_ resource.ResourceWithConfigure   = (*volumeResource)(nil)
	_ resource.ResourceWithImportState = (*volumeResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*volumeResource)(nil)
)

// NewVolumeResource is the kvm_volume resource.
func NewVolumeResource() resource.Resource { return &volumeResource{} }

type volumeResource struct {
	data *providerData
}

// volumeModel is a volume as kvm_volume (resource and data source) stores it.
type volumeModel struct {
	ID         types.String `tfsdk:"id"`
	Name       types.String `tfsdk:"name"`
	Project    types.String `tfsdk:"project"`
	SizeMiB    types.Int64  `tfsdk:"size_mib"`
	Host       types.String `tfsdk:"host"`
	Source     types.Object `tfsdk:"source"`
	Labels     types.Map    `tfsdk:"labels"`
	State      types.String `tfsdk:"state"`
	Serial     types.String `tfsdk:"serial"`
	Device     types.String `tfsdk:"device"`
	AttachedTo types.List   `tfsdk:"attached_to"`
}

var volumeSourceTypes = map[string]attr.Type{"image": types.StringType, "volume": types.StringType}

// fromAPI records what the control API says. The source stays as
// configured (a volume named by name reads back as its id), except on an
// import, where state has none yet.
func (m *volumeModel) fromAPI(v api.Volume) {
	m.ID = types.StringValue(v.ID)
	m.Name = types.StringValue(v.Name)
	m.Project = types.StringValue(v.Project)
	m.SizeMiB = types.Int64Value(v.SizeMiB)
	m.Host = types.StringValue(v.Host)
	m.Labels = labelsValue(v.Labels)
	m.State = types.StringValue(v.State)
	m.Serial = types.StringValue(v.Serial)
	m.Device = types.StringValue(v.Device)
	vms := make([]attr.Value, 0, len(v.AttachedTo))
	for _, a := range v.AttachedTo {
		vms = append(vms, types.StringValue(a.VMID))
	}
	m.AttachedTo = types.ListValueMust(types.StringType, vms)
	if m.Source.IsNull() || m.Source.IsUnknown() {
		m.Source = types.ObjectNull(volumeSourceTypes)
		if v.Source != nil {
			m.Source = types.ObjectValueMust(volumeSourceTypes, map[string]attr.Value{
				"image": optionalString(v.Source.Image), "volume": optionalString(v.Source.Volume)})
		}
	}
}

func (r *volumeResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_volume"
}

func (r *volumeResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	replaceString := []planmodifier.String{stringplanmodifier.RequiresReplace()}
	fixed := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A volume: a qcow2 disk on one host that outlives the VMs it is attached to, so a VM " +
			"replaced for new `user_data` or a new image keeps its data. Attach it with a `volume_attachment` block " +
			"of `kvm_vm`; the VM is then placed on the volume's host. `size_mib` grows in place and never shrinks; " +
			"`name` and `source` replace the volume (which destroys its data). Deleting a volume that a VM " +
			"has attached is refused: destroy or change that VM first (Terraform does, when the VM refers to the volume). " +
			"Changing `host` moves the volume to that host in place, keeping its data; only a detached volume moves.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "Id of the volume (a random UUID). `terraform import` takes it, or the name.",
				Computed:            true,
				PlanModifiers:       fixed,
			},
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the volume, unique in its project.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthBetween(1, 63)},
				PlanModifiers:       replaceString,
			},
			"project": schema.StringAttribute{
				MarkdownDescription: "Project the volume belongs to: the provider's `project`, or the token's.",
				Computed:            true,
				PlanModifiers:       fixed,
			},
			"size_mib": schema.Int64Attribute{
				MarkdownDescription: "Size in MiB. A larger value grows the volume in place (online while a VM has it " +
					"attached); a smaller one is refused at plan time: a volume never shrinks. It counts against its " +
					"host's disk and its project's `disk_mib` quota.",
				Required:   true,
				Validators: []validator.Int64{int64validator.AtLeast(1)},
			},
			"host": schema.StringAttribute{
				MarkdownDescription: "Host the volume lives on. Leave it out to let the scheduler place it by free " +
					"disk (a clone goes to its source's host). Changing it moves the volume in place, keeping its id " +
					"and data: the new host's agent pulls it from the old one (its sha256 checked while it streams), " +
					"then the old copy is deleted. Only a detached volume moves: remove its `volume_attachment` " +
					"blocks first (an apply of its own). Removing `host` from the configuration keeps the volume where it is.",
				Optional:      true,
				Computed:      true,
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"source": schema.SingleNestedAttribute{
				MarkdownDescription: "What the volume starts with; omitted: an empty disk. Changing it replaces the volume.",
				Optional:            true,
				PlanModifiers:       []planmodifier.Object{objectplanmodifier.RequiresReplace()},
				Attributes: map[string]schema.Attribute{
					"image": schema.StringAttribute{
						MarkdownDescription: "An image's disk content (a host's built-in image or a registered `kvm_image`), grown to `size_mib`.",
						Optional:            true,
					},
					"volume": schema.StringAttribute{
						MarkdownDescription: "Another volume (name or id) of the project: a copy-on-write clone on its host. " +
							"`size_mib` must be at least the source's.",
						Optional: true,
					},
				},
			},
			"labels": schema.MapAttribute{
				MarkdownDescription: "Labels of the volume (string keys and values). Changed in place.",
				ElementType:         types.StringType,
				Optional:            true,
				Computed:            true,
				Default:             mapdefault.StaticValue(labelsValue(nil)),
			},
			"state": schema.StringAttribute{
				MarkdownDescription: "`creating`, `ready`, `moving` (to another host), `deleting` or `error`.",
				Computed:            true,
			},
			"serial": schema.StringAttribute{
				MarkdownDescription: "Serial the guest sees the disk by: the first 20 hex digits of the id.",
				Computed:            true,
				PlanModifiers:       fixed,
			},
			"device": schema.StringAttribute{
				MarkdownDescription: "Stable path of the disk in a guest that has it attached, " +
					"`/dev/disk/by-id/virtio-<serial>`: name it in fstab or cloud-init `mounts`.",
				Computed:      true,
				PlanModifiers: fixed,
			},
			"attached_to": schema.ListAttribute{
				MarkdownDescription: "Ids of the VMs that have the volume attached (none, one read-write, or several read-only).",
				ElementType:         types.StringType,
				Computed:            true,
			},
		},
	}
}

func (r *volumeResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan refuses a smaller size_mib: a volume never shrinks, and a
// replace would destroy its data.
func (r *volumeResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() || req.State.Raw.IsNull() {
		return
	}
	var plan, state volumeModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if !plan.SizeMiB.IsUnknown() && plan.SizeMiB.ValueInt64() < state.SizeMiB.ValueInt64() {
		resp.Diagnostics.AddAttributeError(path.Root("size_mib"), summaryVolumeShrink, fmt.Sprintf(
			"Volume %q has %d MiB and a volume never shrinks; size_mib = %d would lose data. Keep size_mib at %d or more, "+
				"or make a new volume (another name) and copy what you need.",
			state.Name.ValueString(), state.SizeMiB.ValueInt64(), plan.SizeMiB.ValueInt64(), state.SizeMiB.ValueInt64()))
	}
	if to := plan.Host.ValueString(); !plan.Host.IsUnknown() && !plan.Host.IsNull() && to != state.Host.ValueString() {
		var vms []string
		resp.Diagnostics.Append(state.AttachedTo.ElementsAs(ctx, &vms, false)...)
		if len(vms) > 0 {
			resp.Diagnostics.AddAttributeWarning(path.Root("host"), summaryVolumeMoveAttached, fmt.Sprintf(
				"Volume %q moves from host %s to host %s, but it is attached to VM %s; only a detached volume moves, so the "+
					"apply fails unless that VM lets it go first. Remove its volume_attachment block (or destroy the VM) and apply, "+
					"then change host.", state.Name.ValueString(), state.Host.ValueString(), to, strings.Join(vms, ", ")))
		}
	}
}

func (r *volumeResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan volumeModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	labels, diags := labelsFromValue(ctx, plan.Labels)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	in := api.VolumeCreate{Name: plan.Name.ValueString(), Project: r.data.project, SizeMiB: plan.SizeMiB.ValueInt64(),
		Host: plan.Host.ValueString(), Labels: labels, Source: volumeSourceOf(plan.Source)}
	v, err := r.data.client.CreateVolume(ctx, in)
	r.data.wrote()
	if err != nil {
		if errors.Is(err, client.ErrConflict) {
			resp.Diagnostics.AddError(summaryCreateVolume, fmt.Sprintf("The control API refused volume %q: %s. To manage an "+
				"existing volume, import it: terraform import kvm_volume.<name> %s; otherwise choose another name.\n\nError: %s",
				in.Name, "its name is taken or its source is busy", in.Name, err))
			return
		}
		addCreateInProjectError(&resp.Diagnostics, summaryCreateVolume, fmt.Sprintf("creating volume %q", in.Name), in.Project, err)
		return
	}
	tflog.Info(ctx, "created volume", map[string]any{"id": v.ID, "name": v.Name, "host": v.Host, "size_mib": v.SizeMiB})
	plan.fromAPI(v)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

// volumeSourceOf is the create body's source (nil: an empty disk).
func volumeSourceOf(o types.Object) *api.VolumeSource {
	if o.IsNull() || o.IsUnknown() {
		return nil
	}
	attrs := o.Attributes()
	str := func(k string) string {
		if s, ok := attrs[k].(types.String); ok {
			return s.ValueString()
		}
		return ""
	}
	return &api.VolumeSource{Image: str("image"), Volume: str("volume")}
}

func (r *volumeResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state volumeModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := state.ID.ValueString()
	v, err := r.data.client.GetVolume(ctx, id)
	if errors.Is(err, client.ErrNotFound) {
		tflog.Info(ctx, "volume is gone from the control API; removing it from state", map[string]any{"id": id})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadVolume, fmt.Sprintf("reading volume %s", id), err)
		return
	}
	state.fromAPI(v)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *volumeResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state volumeModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	labels, diags := labelsFromValue(ctx, plan.Labels)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := state.ID.ValueString()
	if to := plan.Host.ValueString(); !plan.Host.IsUnknown() && !plan.Host.IsNull() && to != state.Host.ValueString() {
		if !r.moveVolume(ctx, state, to, &resp.Diagnostics) {
			return
		}
	}
	patch := api.VolumePatch{Labels: &labels}
	if size := plan.SizeMiB.ValueInt64(); size != state.SizeMiB.ValueInt64() {
		patch.SizeMiB = &size
	}
	v, err := r.data.client.UpdateVolume(ctx, id, patch)
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateVolume, fmt.Sprintf("updating volume %s", id), err)
		return
	}
	plan.fromAPI(v)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *volumeResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state volumeModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := state.ID.ValueString()
	err := r.data.client.DeleteVolume(ctx, id)
	r.data.wrote()
	addDeleteError(&resp.Diagnostics, summaryDeleteVolume, fmt.Sprintf("deleting volume %s", id), err, fmt.Sprintf(
		"Volume %q (%s) is attached to a VM, so the control API keeps it (the error names the VM). Remove the "+
			"volume_attachment block from that kvm_vm, or destroy the VM, then run terraform again.", state.Name.ValueString(), id))
}

func (r *volumeResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	v, err := r.data.client.GetVolume(ctx, req.ID)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadVolume, fmt.Sprintf("importing volume %q (an id or a name)", req.ID), err)
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), v.ID)...)
}
