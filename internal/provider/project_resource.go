package provider

import (
	"context"
	"errors"
	"fmt"
	"regexp"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/mapdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/objectdefault"
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
	_ resource.Resource                = (*projectResource)(nil)
	_ resource.ResourceWithConfigure   = (*projectResource)(nil)
	_ resource.ResourceWithImportState = (*projectResource)(nil)
)

// projectNamePattern is the control API's rule for project names: a DNS
// label.
var projectNamePattern = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

const projectNameRule = "a DNS label: 1 to 63 lowercase letters, digits and '-', starting and ending with a " +
	"letter or digit"

func projectNameValidator() validator.String {
	return stringvalidator.RegexMatches(projectNamePattern, "must be "+projectNameRule)
}

// quotaAttrTypes is the object type of quotas: a null field is unlimited.
// usageAttrTypes (what the project's VMs hold) has the same fields.
var (
	quotaAttrTypes = map[string]attr.Type{
		api.ResourceVCPUs:     types.Int64Type,
		api.ResourceMemoryMiB: types.Int64Type,
		api.ResourceDiskMiB:   types.Int64Type,
		api.ResourceVMs:       types.Int64Type,
	}
	usageAttrTypes = quotaAttrTypes
)

// NewProjectResource is the kvm_project resource.
func NewProjectResource() resource.Resource { return &projectResource{} }

type projectResource struct {
	data *providerData
}

// projectModel is a project as kvm_project (resource and data source) stores it.
type projectModel struct {
	ID          types.String `tfsdk:"id"`
	Name        types.String `tfsdk:"name"`
	Description types.String `tfsdk:"description"`
	Quotas      types.Object `tfsdk:"quotas"`
	HostLabels  types.Map    `tfsdk:"host_labels"`
	Usage       types.Object `tfsdk:"usage"`
	CreatedAt   types.String `tfsdk:"created_at"`
}

func (m *projectModel) fromAPI(p api.Project) {
	m.ID = types.StringValue(p.Name)
	m.Name = types.StringValue(p.Name)
	m.Description = types.StringValue(p.Description)
	m.Quotas = quotasObject(p.Quotas)
	m.HostLabels = labelsValue(p.HostLabels)
	m.Usage = types.ObjectValueMust(usageAttrTypes, map[string]attr.Value{
		api.ResourceVCPUs:     types.Int64Value(p.Usage.VCPUs),
		api.ResourceMemoryMiB: types.Int64Value(p.Usage.MemoryMiB),
		api.ResourceDiskMiB:   types.Int64Value(p.Usage.DiskMiB),
		api.ResourceVMs:       types.Int64Value(p.Usage.VMs),
	})
	m.CreatedAt = timestamp(p.CreatedAt)
}

// quotasObject is a project's quotas as an object; an unlimited quota is
// null. It is always an object, never null itself, so a configuration
// without quotas (the schema default) and `quotas = {}` read back the same.
func quotasObject(q api.Quotas) types.Object {
	limit := func(v *int64) types.Int64 {
		if v == nil {
			return types.Int64Null()
		}
		return types.Int64Value(*v)
	}
	return types.ObjectValueMust(quotaAttrTypes, map[string]attr.Value{
		api.ResourceVCPUs:     limit(q.VCPUs),
		api.ResourceMemoryMiB: limit(q.MemoryMiB),
		api.ResourceDiskMiB:   limit(q.DiskMiB),
		api.ResourceVMs:       limit(q.VMs),
	})
}

// quotasFromObject reads the quotas attribute; null or unknown fields are
// unlimited.
func quotasFromObject(v types.Object) api.Quotas {
	if v.IsNull() || v.IsUnknown() {
		return api.Quotas{}
	}
	attrs := v.Attributes()
	limit := func(name string) *int64 {
		n, ok := attrs[name].(types.Int64)
		if !ok || n.IsNull() || n.IsUnknown() {
			return nil
		}
		x := n.ValueInt64()
		return &x
	}
	return api.Quotas{
		VCPUs:     limit(api.ResourceVCPUs),
		MemoryMiB: limit(api.ResourceMemoryMiB),
		DiskMiB:   limit(api.ResourceDiskMiB),
		VMs:       limit(api.ResourceVMs),
	}
}

func (r *projectResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_project"
}

func (r *projectResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	quota := func(what string) schema.Int64Attribute {
		return schema.Int64Attribute{
			MarkdownDescription: "At most " + what + " at once; unset is unlimited.",
			Optional:            true,
			Validators:          []validator.Int64{int64validator.AtLeast(0)},
		}
	}
	usage := func(what string) schema.Int64Attribute {
		return schema.Int64Attribute{MarkdownDescription: what + " now.", Computed: true}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A project: a team's share of the fleet, with quotas and the hosts its VMs may run on. " +
			"VMs, forks and networks belong to one project; a project token (made with `POST /v1/tokens` and a `project`) sees and " +
			"acts on its own project's objects only. Managing projects needs an admin token. `description`, `quotas` " +
			"and `host_labels` change in place; a new `name` replaces the project, which the control API refuses " +
			"while it holds VMs, forks or networks. Every object made without a project belongs to the built-in " +
			"project `default`.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "The project's name.",
				Computed:            true,
				PlanModifiers:       []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the project, a DNS label (lowercase letters, digits and `-`, at most 63). " +
					"Changing it replaces the project. `terraform import` takes it.",
				Required:      true,
				Validators:    []validator.String{projectNameValidator()},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"description": schema.StringAttribute{
				MarkdownDescription: "Free text for people. Changed in place. Defaults to empty.",
				Optional:            true,
				Computed:            true,
				Default:             stringdefault.StaticString(""),
			},
			"quotas": schema.SingleNestedAttribute{
				MarkdownDescription: "Limits on what the project's VMs (fork children included) hold at once. A quota " +
					"left out is unlimited; no `quotas` at all means no limits. Changed in place, all four at once. A " +
					"create or resize that would pass a limit fails with an error naming the project and the quota; " +
					"a limit below the current `usage` is accepted and only refuses growth (nothing running stops).",
				Optional: true,
				Computed: true,
				Default:  objectdefault.StaticValue(quotasObject(api.Quotas{})),
				Attributes: map[string]schema.Attribute{
					api.ResourceVCPUs:     quota("this many virtual CPUs held by the project's VMs"),
					api.ResourceMemoryMiB: quota("this many MiB of memory held by the project's VMs"),
					api.ResourceDiskMiB:   quota("this many MiB of disk held by the project's VMs"),
					api.ResourceVMs:       quota("this many VMs in the project"),
				},
			},
			"host_labels": schema.MapAttribute{
				MarkdownDescription: "Labels a host must all have to run the project's VMs (in addition to each VM's " +
					"own `constraints`). Empty (the default): any host. Changed in place; VMs already placed stay " +
					"where they are.",
				ElementType: types.StringType,
				Optional:    true,
				Computed:    true,
				Default:     mapdefault.StaticValue(labelsValue(nil)),
			},
			"usage": schema.SingleNestedAttribute{
				MarkdownDescription: "What the project's VMs hold now. It changes whenever VMs of the project are " +
					"created, resized or deleted, by this configuration or another; each refresh reads it.",
				Computed: true,
				Attributes: map[string]schema.Attribute{
					api.ResourceVCPUs:     usage("Virtual CPUs the project's VMs hold"),
					api.ResourceMemoryMiB: usage("MiB of memory the project's VMs hold"),
					api.ResourceDiskMiB:   usage("MiB of disk the project's VMs hold"),
					api.ResourceVMs:       usage("VMs of the project that hold capacity on a host"),
				},
			},
			"created_at": schema.StringAttribute{
				MarkdownDescription: "When the project was created (RFC 3339, UTC).",
				Computed:            true,
				PlanModifiers:       []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
		},
	}
}

func (r *projectResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (r *projectResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan projectModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	hostLabels, diags := labelsFromValue(ctx, plan.HostLabels)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	in := api.ProjectCreate{Name: plan.Name.ValueString(), Description: plan.Description.ValueString(),
		Quotas: quotasFromObject(plan.Quotas), HostLabels: hostLabels}
	p, err := r.data.client.CreateProject(ctx, in)
	if err != nil {
		if errors.Is(err, client.ErrConflict) {
			resp.Diagnostics.AddAttributeError(path.Root("name"), summaryProjectExists, fmt.Sprintf(
				"A project named %q already exists. To manage it, import it: terraform import kvm_project.<name> %s; "+
					"otherwise choose another name.\n\nError: %s", in.Name, in.Name, err))
			return
		}
		addAPIError(&resp.Diagnostics, summaryCreateProject, fmt.Sprintf("creating project %q", in.Name), err)
		return
	}
	tflog.Info(ctx, "created project", map[string]any{"name": p.Name})
	plan.fromAPI(p)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *projectResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state projectModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	p, err := r.data.client.GetProject(ctx, name)
	if errors.Is(err, client.ErrNotFound) {
		tflog.Info(ctx, "project is gone from the control API; removing it from state", map[string]any{"name": name})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadProject, fmt.Sprintf("reading project %q", name), err)
		return
	}
	state.fromAPI(p)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *projectResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan projectModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	patch, diags := projectPatch(ctx, plan)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	p, err := r.data.client.UpdateProject(ctx, name, patch)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateProject, fmt.Sprintf("updating project %q", name), err)
		return
	}
	plan.fromAPI(p)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

// projectPatch sends the whole in-place desired state: PATCH is idempotent,
// and quotas replace all four limits, so a quota removed from the
// configuration becomes unlimited.
func projectPatch(ctx context.Context, plan projectModel) (api.ProjectPatch, diag.Diagnostics) {
	hostLabels, diags := labelsFromValue(ctx, plan.HostLabels)
	description := plan.Description.ValueString()
	quotas := quotasFromObject(plan.Quotas)
	return api.ProjectPatch{Description: &description, Quotas: &quotas, HostLabels: &hostLabels}, diags
}

func (r *projectResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state projectModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	err := r.data.client.DeleteProject(ctx, name)
	addDeleteError(&resp.Diagnostics, summaryDeleteProject, fmt.Sprintf("deleting project %q", name), err, fmt.Sprintf(
		"Project %q still holds VMs, forks or networks, so the control API keeps it. Delete them first (resources "+
			"created with the provider's project = %q are destroyed before the project when they depend on it), then "+
			"run terraform destroy again.", name, name))
}

func (r *projectResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	if req.ID == "" {
		resp.Diagnostics.AddError(summaryReadProject, "Import a project by its name: terraform import kvm_project.<name> <name>.")
		return
	}
	resource.ImportStatePassthroughID(ctx, path.Root("name"), req, resp)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), req.ID)...)
}
