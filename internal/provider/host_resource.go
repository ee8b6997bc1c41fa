package provider

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework-validators/float64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/float64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/mapdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// Defaults of a host registration; they match what the control API applies
// when a PUT leaves the field out, so an unset argument never shows a diff.
const (
	defaultSchedulable        = true
	defaultCPUAllocationRatio = 1.0
	defaultMemoryReservedMiB  = 0
)

var (
	_ resource.Resource                = (*hostResource)(nil)
	_ resource.ResourceWithConfigure   = (*hostResource)(nil)
	_ resource.ResourceWithImportState = (*hostResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*hostResource)(nil)
)

// NewHostResource is the kvm_host resource.
func NewHostResource() resource.Resource { return &hostResource{} }

type hostResource struct {
	data *providerData
}

func (r *hostResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_host"
}

func resourcesAttribute(description string) schema.SingleNestedAttribute {
	return schema.SingleNestedAttribute{
		MarkdownDescription: description,
		Computed:            true,
		Attributes: map[string]schema.Attribute{
			"vcpus":      schema.Int64Attribute{MarkdownDescription: "Virtual CPUs.", Computed: true},
			"memory_mib": schema.Int64Attribute{MarkdownDescription: "Memory in MiB.", Computed: true},
			"disk_mib":   schema.Int64Attribute{MarkdownDescription: "Disk in MiB.", Computed: true},
		},
	}
}

func (r *hostResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Registers a host agent (`kvmd agent`) with the control API, which then reads its capacity " +
			"and places VMs on it. Deleting the resource deregisters the host; the control API refuses while VMs are " +
			"placed there, so delete or move them first (a `kvm_vm` that pins `host = kvm_host.x.name` is destroyed " +
			"before its host).",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the host, unique in the fleet. `terraform import` takes it. Changing it " +
					"deregisters the host and registers it again under the new name.",
				Required:      true,
				Validators:    []validator.String{stringvalidator.LengthAtLeast(1)},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"address": schema.StringAttribute{
				MarkdownDescription: "Address of the host agent's API, `scheme://host:port` and nothing else (for example " +
					"`https://kvm-01.example.net:8471`; `http://` only on loopback, or off it when the control plane runs with `--allow-insecure-agents`). Before the control " +
					"plane sends the agent token there, the agent at this address proves that it holds the agent token and " +
					"the control plane pins its identity key. Changing the address moves the host in place only when the agent " +
					"at the new address proves that same key (the same agent, moved); another agent is refused. An agent known " +
					"by a DNS name or behind a proxy is started with `--advertise-url` naming this address.",
				Required:   true,
				Validators: []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"underlay_address": schema.StringAttribute{
				MarkdownDescription: "IPv4 address of the host on the network between the hosts, where the VXLAN tunnels " +
					"of `overlay` networks (UDP 4789) start and end. The agent must have it on one of its interfaces and be " +
					"started with `--underlay-address` naming it: it proves the address in the same identity challenge as " +
					"`address`, and registration fails when it does not. Left out, the host takes no VM with an `overlay` " +
					"NIC. Changed in place.",
				Optional:   true,
				Validators: []validator.String{stringvalidator.LengthAtLeast(7)},
			},
			"labels": schema.MapAttribute{
				MarkdownDescription: "Labels of the host (string keys and values). VM `constraints` select hosts by them " +
					"(`host_labels`) and spread groups by them (`spread_by = \"label:<key>\"`). Changed in place; VMs " +
					"already placed never move when they change, and a VM whose host no longer matches reports it in " +
					"`constraints_violated`.",
				ElementType: types.StringType,
				Optional:    true,
				Computed:    true,
				Default:     mapdefault.StaticValue(labelsValue(nil)),
			},
			"schedulable": schema.BoolAttribute{
				MarkdownDescription: "Whether new VMs may be placed on the host; `false` drains it of new placements " +
					"while its VMs keep running. Defaults to `true`.",
				Optional: true,
				Computed: true,
				Default:  booldefault.StaticBool(defaultSchedulable),
			},
			"cpu_allocation_ratio": schema.Float64Attribute{
				MarkdownDescription: "How many vCPUs may be allocated per physical CPU (overcommit). Defaults to `1.0`.",
				Optional:            true,
				Computed:            true,
				Default:             float64default.StaticFloat64(defaultCPUAllocationRatio),
				Validators:          []validator.Float64{float64validator.AtLeast(0.01)},
			},
			"memory_reserved_mib": schema.Int64Attribute{
				MarkdownDescription: "Memory in MiB kept back for the host itself; never allocated to VMs. Defaults to `0`.",
				Optional:            true,
				Computed:            true,
				Default:             int64default.StaticInt64(defaultMemoryReservedMiB),
				Validators:          []validator.Int64{int64validator.AtLeast(0)},
			},
			"capacity":  resourcesAttribute("What the host can allocate to VMs: (total - reserved) x allocation ratio."),
			"allocated": resourcesAttribute("What the VMs placed on the host have reserved."),
			"free":      resourcesAttribute("Capacity minus allocated and warm."),
			"warm": resourcesAttribute("What the host's warm pool holds (ready and booting warm VMs). A new VM may still " +
				"use this share: the host's agent evicts warm VMs to make room before a create is refused."),
			"isolation": schema.StringAttribute{
				MarkdownDescription: "How the host's agent holds each VM to its shape: `cgroup v2: ...` (each QEMU in its own " +
					"cgroup with `memory.max` and `cpu.max` from the VM's shape), or `none: <why>` (the agent not root, or no " +
					"cgroup v2 memory and cpu controllers).",
				Computed: true,
			},
			"retired": schema.BoolAttribute{
				MarkdownDescription: "Set to `true` to retire a host whose agent is gone for good (the host shows `alive = false`): " +
					"in one admin action the control API marks every VM placed there `lost` and releases their capacity, and the " +
					"host takes no VM again. The plan warns with the VMs that will be lost; their `kvm_vm` resources are planned " +
					"again elsewhere on the next run. A host whose agent still answers is refused. It cannot be undone: " +
					"destroying the resource deregisters the host and removes its lost VMs; register the machine again as a new " +
					"host. Defaults to `false`.",
				Optional: true,
				Computed: true,
				Default:  booldefault.StaticBool(false),
			},
			"retired_at": schema.StringAttribute{
				MarkdownDescription: "When the host was retired (RFC 3339, UTC); null while it is in service.",
				Computed:            true,
			},
			"drain": schema.BoolAttribute{
				MarkdownDescription: drainDescription,
				Optional:            true,
				Computed:            true,
				Default:             booldefault.StaticBool(false),
			},
			"drain_status": drainStatusResourceAttribute(),
			"alive": schema.BoolAttribute{
				MarkdownDescription: "Whether the host agent answered the control API's last check.",
				Computed:            true,
			},
			"accel": schema.StringAttribute{
				MarkdownDescription: "Accelerator the agent runs guests with: `kvm` or `tcg` (emulation).",
				Computed:            true,
			},
			"driver": schema.StringAttribute{
				MarkdownDescription: "VMM driver of the agent: `qemu`, or `sim` (simulated, for tests and benchmarks).",
				Computed:            true,
			},
			"images": schema.ListAttribute{
				MarkdownDescription: "Guest images the host offers.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"warm_pool": warmPoolResourceAttribute(),
		},
	}
}

func (r *hostResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func hostPut(ctx context.Context, m hostModel) (api.HostPut, error) {
	labels, diags := labelsFromValue(ctx, m.Labels)
	if diags.HasError() {
		return api.HostPut{}, fmt.Errorf("labels: %v", diags)
	}
	schedulable := m.Schedulable.ValueBool()
	ratio := m.CPUAllocationRatio.ValueFloat64()
	reserved := m.MemoryReservedMiB.ValueInt64()
	warm, err := warmPoolFromValue(ctx, m.WarmPool)
	if err != nil {
		return api.HostPut{}, err
	}
	return api.HostPut{
		Address:            m.Address.ValueString(),
		UnderlayAddress:    m.UnderlayAddress.ValueString(),
		Labels:             labels,
		Schedulable:        &schedulable,
		CPUAllocationRatio: &ratio,
		MemoryReservedMiB:  &reserved,
		WarmPool:           warm,
	}, nil
}

func (r *hostResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan hostModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	subject := fmt.Sprintf("registering host %q", name)
	if plan.Retired.ValueBool() {
		resp.Diagnostics.AddAttributeError(path.Root("retired"), summaryCreateHost, fmt.Sprintf(
			"Host %q cannot be registered retired: retire a registered host whose agent is gone for good. Remove retired = true.", name))
		return
	}

	// PUT registers or overwrites; refuse to silently take over a host that
	// someone else registered.
	_, err := r.data.client.GetHost(ctx, name)
	switch {
	case err == nil:
		resp.Diagnostics.AddAttributeError(path.Root("name"), summaryHostAlreadyExists, fmt.Sprintf(
			"Host %q is already registered with the control API. Import it with \"terraform import kvm_host.<name> %s\" "+
				"to manage it here, or choose another name.", name, name))
		return
	case !errors.Is(err, client.ErrNotFound):
		addAPIError(&resp.Diagnostics, summaryCreateHost, subject, err)
		return
	}

	in, err := hostPut(ctx, plan)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("labels"), summaryCreateHost, err.Error())
		return
	}
	h, err := r.data.client.PutHost(ctx, name, in)
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryCreateHost, subject, err)
		return
	}
	tflog.Info(ctx, "registered host", map[string]any{"name": name, "address": h.Address, "alive": h.Alive})
	if plan.Drain.ValueBool() {
		h, err = applyDrain(ctx, r.data.client, name, true)
		r.data.wrote()
		if err != nil {
			addAPIError(&resp.Diagnostics, summaryCreateHost, fmt.Sprintf("draining host %q", name), err)
			return
		}
	}
	plan.fromAPI(h)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *hostResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state hostModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	h, err := r.data.getHost(ctx, name)
	if errors.Is(err, client.ErrNotFound) {
		tflog.Info(ctx, "host is no longer registered; removing it from state", map[string]any{"name": name})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadHost, fmt.Sprintf("reading host %q", name), err)
		return
	}
	state.fromAPI(h)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *hostResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state hostModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	if plan.Retired.ValueBool() && !state.Retired.ValueBool() {
		// The agent is gone: nothing else of the host can change, only the retire.
		if !plan.Address.Equal(state.Address) || !plan.UnderlayAddress.Equal(state.UnderlayAddress) || !plan.Labels.Equal(state.Labels) || !plan.Schedulable.Equal(state.Schedulable) ||
			!plan.CPUAllocationRatio.Equal(state.CPUAllocationRatio) || !plan.MemoryReservedMiB.Equal(state.MemoryReservedMiB) ||
			!plan.WarmPool.Equal(state.WarmPool) {
			resp.Diagnostics.AddAttributeError(path.Root("retired"), summaryUpdateHost, fmt.Sprintf(
				"Host %q is to be retired together with other changes. A host is retired because its agent is gone, so "+
					"nothing else of it can change: apply retired = true alone, with its other arguments as they are.", name))
			return
		}
		h, err := r.data.client.RetireHost(ctx, name)
		r.data.wrote()
		if err != nil {
			addAPIError(&resp.Diagnostics, summaryUpdateHost, fmt.Sprintf("retiring host %q", name), err)
			return
		}
		tflog.Warn(ctx, "retired host; its VMs are lost", map[string]any{"name": name, "retired_at": h.RetiredAt})
		plan.fromAPI(h)
		resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
		return
	}
	in, err := hostPut(ctx, plan)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("labels"), summaryUpdateHost, err.Error())
		return
	}
	h, err := r.data.client.PutHost(ctx, name, in)
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateHost, fmt.Sprintf("updating host %q", name), err)
		return
	}
	if drain := plan.Drain.ValueBool(); drain != state.Drain.ValueBool() ||
		(drain && h.Drain.State != api.DrainDrained) {
		tflog.Info(ctx, "changing the host's drain", map[string]any{"name": name, "drain": drain})
		dh, derr := applyDrain(ctx, r.data.client, name, drain)
		r.data.wrote()
		if derr != nil {
			if dh.Name != "" {
				// What the drain did so far is the host's state now.
				plan.fromAPI(dh)
				plan.Drain = types.BoolValue(drain)
				resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
			}
			addAPIError(&resp.Diagnostics, summaryUpdateHost, fmt.Sprintf("draining host %q", name), derr)
			return
		}
		h = dh
	}
	plan.fromAPI(h)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *hostResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state hostModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	err := r.data.client.DeleteHost(ctx, name)
	r.data.wrote()
	addDeleteError(&resp.Diagnostics, summaryDeleteHost, fmt.Sprintf("deregistering host %q", name), err, fmt.Sprintf(
		"Host %q still has VMs placed on it, so the control API keeps it registered. Delete those VMs (or let "+
			"Terraform destroy them first: pin them with host = kvm_host.<name>.name, or add depends_on), then run "+
			"terraform destroy again.", name))
}

func (r *hostResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	resource.ImportStatePassthroughID(ctx, path.Root("name"), req, resp)
}

// ModifyPlan shows what a retire does before it is applied: a warning names
// the VMs the host's retire marks lost. Un-retiring is refused: a retired
// host never comes back.
func (r *hostResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.State.Raw.IsNull() || req.Plan.Raw.IsNull() || r.data == nil {
		return
	}
	var plan, state hostModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() || plan.Retired.IsUnknown() {
		return
	}
	name := state.Name.ValueString()
	switch {
	case state.Retired.ValueBool() && !plan.Retired.ValueBool():
		resp.Diagnostics.AddAttributeError(path.Root("retired"), summaryUpdateHost, fmt.Sprintf(
			"Host %q is retired and cannot return to service. Keep retired = true, or destroy the resource (which "+
				"deregisters the host and removes its lost VMs) and register the machine again as a new host.", name))
	case plan.Retired.ValueBool() && !state.Retired.ValueBool():
		vms, err := r.data.client.AllVMs(ctx, client.ListOptions{Host: name})
		if err != nil {
			addAPIError(&resp.Diagnostics, summaryUpdateHost, fmt.Sprintf("listing the VMs of host %q to plan its retire", name), err)
			return
		}
		names := make([]string, 0, len(vms))
		for _, vm := range vms {
			if !api.Gone(vm.ObservedState) {
				names = append(names, vm.Name)
			}
		}
		detail := fmt.Sprintf("Host %q will be retired: it takes no VM again and cannot return to service.", name)
		if len(names) > 0 {
			detail += fmt.Sprintf(" Its %d VMs will be marked lost and their capacity released: %s. Their kvm_vm "+
				"resources are planned again, on other hosts, on the next plan.", len(names), strings.Join(names, ", "))
		}
		if state.Alive.ValueBool() {
			detail += " Its agent answered at the last refresh: the control API refuses to retire a host whose agent still " +
				"answers (stop it, or wait until the host shows alive = false)."
		}
		resp.Diagnostics.AddAttributeWarning(path.Root("retired"), "Host will be retired", detail)
	}
}
