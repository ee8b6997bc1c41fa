package provider

import (
	"context"
	"errors"
	"fmt"
	"regexp"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ resource.Resource                = (*imageResource)(nil)
	_ resource.ResourceWithConfigure   = (*imageResource)(nil)
	_ resource.ResourceWithImportState = (*imageResource)(nil)
)

// NewImageResource is the kvm_image resource.
func NewImageResource() resource.Resource { return &imageResource{} }

type imageResource struct {
	data *providerData
}

// imageModel is kvm_image's state (and, all computed, the data source's).
type imageModel struct {
	Name           types.String `tfsdk:"name"`
	SourceURL      types.String `tfsdk:"source_url"`
	SHA256         types.String `tfsdk:"sha256"`
	Format         types.String `tfsdk:"format"`
	MinDiskMiB     types.Int64  `tfsdk:"min_disk_mib"`
	Prefetch       types.Bool   `tfsdk:"prefetch"`
	Firmware       types.String `tfsdk:"firmware"`
	SizeBytes      types.Int64  `tfsdk:"size_bytes"`
	VirtualSizeMiB types.Int64  `tfsdk:"virtual_size_mib"`
	Hosts          types.List   `tfsdk:"hosts"`
}

var imageHostType = types.ObjectType{AttrTypes: map[string]attr.Type{
	"host": types.StringType, "status": types.StringType, "reason": types.StringType,
}}

func (m *imageModel) fromAPI(img api.Image) {
	m.Name = types.StringValue(img.Name)
	m.SourceURL = types.StringValue(img.SourceURL)
	m.SHA256 = types.StringValue(img.SHA256)
	m.Format = types.StringValue(img.Format)
	m.MinDiskMiB = types.Int64Value(img.MinDiskMiB)
	m.Prefetch = types.BoolValue(img.Prefetch)
	m.Firmware = types.StringValue(img.Firmware)
	if img.Firmware == "" {
		m.Firmware = types.StringValue(api.FirmwareBIOS)
	}
	m.SizeBytes = types.Int64Value(img.SizeBytes)
	m.VirtualSizeMiB = types.Int64Value(img.VirtualSizeMiB)
	hosts := make([]attr.Value, 0, len(img.Hosts))
	for _, h := range img.Hosts {
		hosts = append(hosts, types.ObjectValueMust(imageHostType.AttrTypes, map[string]attr.Value{
			"host": types.StringValue(h.Host), "status": types.StringValue(h.Status), "reason": types.StringValue(h.Reason),
		}))
	}
	m.Hosts = types.ListValueMust(imageHostType, hosts)
}

var sha256Regexp = regexp.MustCompile(`^[0-9a-f]{64}$`)

const (
	descImageHosts = "The image on each host that has fetched it, is fetching it or failed to: `host`, `status` " +
		"(`ready`, `fetching` or `failed`) and `reason` (why it failed, e.g. both digests of a mismatch). A host " +
		"that never needed the image is not listed. As last reported by the hosts' agents."
	descImageFirmware = "What VMs of the image boot with: `bios` (SeaBIOS) or `uefi` (OVMF, each VM with its own " +
		"UEFI variable store). A UEFI-only disk (an EFI system partition and no BIOS boot code in its first sector, " +
		"as a GPT cloud image made for UEFI) is refused under `bios` when a VM is created, with a message that says " +
		"to set `firmware = \"uefi\"`; the agent never switches the firmware by itself."
	descImageSize        = "Size in bytes of the file at `source_url`; 0 until a host has fetched it."
	descImageVirtualSize = "Size in MiB of the disk the image holds (a qcow2's virtual size; a raw file's size; a " +
		"kernel bundle's disk, if any); 0 until a host has fetched it. A VM's `disk_mib` cannot be smaller."
)

func (r *imageResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_image"
}

func (r *imageResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Registers a guest image by URL and sha256. The hosts fetch it themselves, the first " +
			"time a VM needs it (or at once with `prefetch`): from another host that has it, else from `source_url`, " +
			"checking the sha256 while the bytes stream, and keep it in their image cache. A `kvm_vm` names it by " +
			"`image = kvm_image.x.name`. Changing `source_url`, `sha256` or `format` replaces the image; the control " +
			"API refuses to delete an image that VMs use, and names them.",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the image, unique in the fleet; VMs name it in `image`. `terraform import` takes it.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthBetween(1, 63)},
				PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"source_url": schema.StringAttribute{
				MarkdownDescription: "Where the hosts fetch the image: an `http://` or `https://` URL, or `file:///path` " +
					"on the hosts (read there with the agent's privileges, which is one reason images take an admin " +
					"token to register). Changing it replaces the image.",
				Required: true,
				Validators: []validator.String{stringvalidator.RegexMatches(regexp.MustCompile(`^(https?|file)://`),
					"must be an http://, https:// or file:// URL")},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"sha256": schema.StringAttribute{
				MarkdownDescription: "sha256 of the file at `source_url`, 64 lower-case hex digits (what `sha256sum` " +
					"prints). A host that fetches other bytes marks the image `failed` and keeps nothing. Changing it " +
					"replaces the image.",
				Required:      true,
				Validators:    []validator.String{stringvalidator.RegexMatches(sha256Regexp, "must be 64 lower-case hex digits")},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"format": schema.StringAttribute{
				MarkdownDescription: "`qcow2` or `raw` (a bootable disk, firmware boot), or `kernel`: a tar whose top " +
					"level holds `image.json` and the files it names (`kernel`, `initrd`, an optional qcow2 `disk`; " +
					"see the guide). The hosts check the file against it when they fetch it: a qcow2 file must be " +
					"self-contained (no backing file, no external data file, not encrypted; flatten one with " +
					"`qemu-img convert -O qcow2`). Changing it replaces the image.",
				Required: true,
				Validators: []validator.String{stringvalidator.OneOf(api.ImageFormatQCOW2, api.ImageFormatRaw,
					api.ImageFormatKernel)},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"min_disk_mib": schema.Int64Attribute{
				MarkdownDescription: "Smallest `disk_mib` a VM of this image may have; a create below it is refused. " +
					"Changes in place. Defaults to `0`.",
				Optional:   true,
				Computed:   true,
				Default:    int64default.StaticInt64(0),
				Validators: []validator.Int64{int64validator.AtLeast(0)},
			},
			"prefetch": schema.BoolAttribute{
				MarkdownDescription: "Fetch the image on every host now (and on hosts that join later) rather than " +
					"when a VM first needs it. Changes in place. Defaults to `false`.",
				Optional: true,
				Computed: true,
				Default:  booldefault.StaticBool(false),
			},
			"firmware": schema.StringAttribute{
				MarkdownDescription: descImageFirmware + " `uefi` needs format `qcow2` or `raw`. Defaults to `bios`. " +
					"Changing it replaces the image (delete its VMs first).",
				Optional:      true,
				Computed:      true,
				Default:       stringdefault.StaticString(api.FirmwareBIOS),
				Validators:    []validator.String{stringvalidator.OneOf(api.FirmwareBIOS, api.FirmwareUEFI)},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"size_bytes":       schema.Int64Attribute{MarkdownDescription: descImageSize, Computed: true},
			"virtual_size_mib": schema.Int64Attribute{MarkdownDescription: descImageVirtualSize, Computed: true},
			"hosts": schema.ListNestedAttribute{
				MarkdownDescription: descImageHosts,
				Computed:            true,
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"host":   schema.StringAttribute{MarkdownDescription: "Name of the host.", Computed: true},
					"status": schema.StringAttribute{MarkdownDescription: "`ready`, `fetching` or `failed`.", Computed: true},
					"reason": schema.StringAttribute{MarkdownDescription: "Why the fetch failed; empty otherwise.", Computed: true},
				}},
			},
		},
	}
}

func (r *imageResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (r *imageResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan imageModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	img, err := r.data.client.CreateImage(ctx, api.ImageCreate{
		Name: name, SourceURL: plan.SourceURL.ValueString(), SHA256: plan.SHA256.ValueString(),
		Format: plan.Format.ValueString(), MinDiskMiB: plan.MinDiskMiB.ValueInt64(), Prefetch: plan.Prefetch.ValueBool(),
		Firmware: plan.Firmware.ValueString(),
	})
	r.data.wrote()
	if errors.Is(err, client.ErrConflict) {
		resp.Diagnostics.AddAttributeError(path.Root("name"), summaryImageAlreadyExists, fmt.Sprintf(
			"An image named %q is already registered with the control API. Import it with \"terraform import "+
				"kvm_image.<name> %s\" to manage it here, or choose another name.\n\nError: %s", name, name, err))
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryCreateImage, fmt.Sprintf("registering image %q", name), err)
		return
	}
	tflog.Info(ctx, "registered image", map[string]any{"name": name, "sha256": img.SHA256, "format": img.Format})
	plan.fromAPI(img)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *imageResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state imageModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	img, err := r.data.client.GetImage(ctx, name)
	if errors.Is(err, client.ErrNotFound) {
		tflog.Info(ctx, "image is no longer registered; removing it from state", map[string]any{"name": name})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadImage, fmt.Sprintf("reading image %q", name), err)
		return
	}
	state.fromAPI(img)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *imageResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan imageModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	minDisk, prefetch := plan.MinDiskMiB.ValueInt64(), plan.Prefetch.ValueBool()
	img, err := r.data.client.UpdateImage(ctx, name, api.ImagePatch{MinDiskMiB: &minDisk, Prefetch: &prefetch})
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateImage, fmt.Sprintf("updating image %q", name), err)
		return
	}
	plan.fromAPI(img)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *imageResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state imageModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	err := r.data.client.DeleteImage(ctx, name)
	r.data.wrote()
	addDeleteError(&resp.Diagnostics, summaryDeleteImage, fmt.Sprintf("deleting image %q", name), err, fmt.Sprintf(
		"Image %q is used by VMs, so the control API keeps it. Delete those VMs first (a kvm_vm with "+
			"image = kvm_image.<name>.name is destroyed before its image), then run terraform destroy again.", name))
}

func (r *imageResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	resource.ImportStatePassthroughID(ctx, path.Root("name"), req, resp)
}
