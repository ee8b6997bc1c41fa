package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/boolplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/setdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/setplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ resource.Resource                = (*networkResource)(nil)
	_ resource.ResourceWithConfigure   = (*networkResource)(nil)
	_ resource.ResourceWithImportState = (*networkResource)(nil)
)

// NewNetworkResource is the kvm_network resource.
func NewNetworkResource() resource.Resource { return &networkResource{} }

type networkResource struct {
	data *providerData
}

// networkModel is a network as kvm_network (resource and data source) stores it.
type networkModel struct {
	Name           types.String `tfsdk:"name"`
	Project        types.String `tfsdk:"project"`
	Mode           types.String `tfsdk:"mode"`
	CIDR           types.String `tfsdk:"cidr"`
	Gateway        types.String `tfsdk:"gateway"`
	DHCP           types.Bool   `tfsdk:"dhcp"`
	Bridge         types.String `tfsdk:"bridge"`
	Hosts          types.Set    `tfsdk:"hosts"`
	Allow          types.Set    `tfsdk:"allow"`
	VNI            types.Int64  `tfsdk:"vni"`
	MTU            types.Int64  `tfsdk:"mtu"`
	AddressesTotal types.Int64  `tfsdk:"addresses_total"`
	AddressesUsed  types.Int64  `tfsdk:"addresses_used"`
}

func (m *networkModel) fromAPI(n api.Network) {
	m.Name = types.StringValue(n.Name)
	m.Project = optionalString(n.Project)
	m.Mode = types.StringValue(n.Mode)
	m.CIDR = optionalString(n.CIDR)
	m.Gateway = optionalString(n.Gateway)
	m.DHCP = types.BoolValue(n.DHCP)
	m.Bridge = optionalString(n.Bridge)
	m.Hosts = stringSet(n.Hosts)
	m.Allow = stringSet(n.Allow)
	// vni and mtu are an overlay's; null for the other modes.
	m.VNI, m.MTU = types.Int64Null(), types.Int64Null()
	if n.Mode == api.NetworkOverlay {
		m.VNI, m.MTU = types.Int64Value(n.VNI), types.Int64Value(n.MTU)
	}
	m.AddressesTotal = types.Int64Value(int64(n.AddressesTotal))
	m.AddressesUsed = types.Int64Value(int64(n.AddressesUsed))
}

func (r *networkResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_network"
}

func (r *networkResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	replaceString := []planmodifier.String{stringplanmodifier.RequiresReplace()}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A named network that VMs attach NICs to (`network_interface` blocks of `kvm_vm`). Modes:\n\n" +
			"- `user`: QEMU user-mode networking, no root needed; each VM sits at `10.0.2.15` behind its own NAT and is " +
			"reached through `port_forward`s on `127.0.0.1` of its host. A network named `default` of this mode exists " +
			"out of the box; VMs without `network_interface` blocks get one NIC on it.\n" +
			"- `nat`: a private network that each host's agent makes (a Linux bridge, a tap per NIC, DHCP with one " +
			"static lease per MAC, masquerade for traffic out). The control plane assigns addresses from `cidr`. " +
			"Its guests reach each other and the outside through NAT; the agents fence off the host itself, the " +
			"other networks and the private ranges unless `allow` lists them, and stop a guest from using another " +
			"guest's MAC or address or answering DHCP.\n" +
			"- `bridge`: taps on an existing Linux `bridge` of the hosts. With a `cidr` the control plane assigns " +
			"addresses and the agent serves them by DHCP; without one, addresses are the bridge network's business.\n" +
			"- `overlay`: one private network across the hosts. Each host has a bridge like `nat`'s (the same " +
			"gateway address and egress NAT on each), joined to the other hosts' by a VXLAN tunnel (`vni`, UDP 4789 " +
			"between the hosts' `underlay_address`es) whose forwarding entries the control plane programs; no " +
			"multicast, no flooding. Its VMs are placed only on hosts with a `kvm_host.underlay_address`, reach each " +
			"other at their addresses whatever host they are on, and keep their address when they migrate. Guests get " +
			"`mtu` by DHCP and in the generated network-config.\n\n" +
			"Only `hosts` changes in place; every other argument replaces the network, which the control API refuses " +
			"while VMs have NICs on it.",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the network, unique in the fleet. `terraform import` takes it.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthBetween(1, 63)},
				PlanModifiers:       replaceString,
			},
			"project": schema.StringAttribute{
				MarkdownDescription: "Project whose VMs may attach to the network, fixed at create: the provider's " +
					"`project`, or when it is left out the token's project (`default` for a fleet-wide token). The name " +
					"is still unique in the whole fleet.",
				Computed:      true,
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"mode": schema.StringAttribute{
				MarkdownDescription: "`user`, `nat`, `bridge` or `overlay` (see above).",
				Required:            true,
				Validators:          []validator.String{stringvalidator.OneOf(api.NetworkUser, api.NetworkNAT, api.NetworkBridge, api.NetworkOverlay)},
				PlanModifiers:       replaceString,
			},
			"cidr": schema.StringAttribute{
				MarkdownDescription: "IPv4 range the control plane assigns addresses from, prefix `/16` to `/30` (for " +
					"example `10.20.0.0/24`). Required for `nat` and `overlay`, optional for `bridge`, not allowed for `user`. It may " +
					"not overlap another network's.",
				Optional:      true,
				PlanModifiers: replaceString,
			},
			"gateway": schema.StringAttribute{
				MarkdownDescription: "Gateway address inside `cidr`; defaults to its first usable address. It is never " +
					"given to a VM.",
				Optional:      true,
				Computed:      true,
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown(), stringplanmodifier.RequiresReplace()},
			},
			"dhcp": schema.BoolAttribute{
				MarkdownDescription: "Whether the agents serve each VM its address by DHCP. Defaults to `true` where the " +
					"network has a `cidr`.",
				Optional:      true,
				Computed:      true,
				PlanModifiers: []planmodifier.Bool{boolplanmodifier.UseStateForUnknown(), boolplanmodifier.RequiresReplace()},
			},
			"bridge": schema.StringAttribute{
				MarkdownDescription: "Name of the existing Linux bridge on the hosts (`bridge` mode only). A VM placed " +
					"on a host without it fails to create with an error naming the bridge and host; limit the network " +
					"with `hosts` to the hosts that have it.",
				Optional:      true,
				PlanModifiers: replaceString,
			},
			"hosts": schema.SetAttribute{
				MarkdownDescription: "Hosts the network is on; VMs with a NIC on it are placed on these hosts only. " +
					"Empty (the default) means every host. Changed in place; VMs already placed stay where they are.",
				ElementType: types.StringType,
				Optional:    true,
				Computed:    true,
				Default:     setdefault.StaticValue(stringSet(nil)),
			},
			"allow": schema.SetAttribute{
				MarkdownDescription: "`nat` and `overlay` networks only: what the network's guests may reach besides their own " +
					"network and the outside through NAT. Each entry is the name of another `nat` network (its guests " +
					"on the same host) or an IPv4 CIDR, e.g. the operator's LAN (`192.168.10.0/24`): the private, " +
					"loopback, link-local (metadata), shared, multicast and reserved ranges are fenced off unless " +
					"listed. It opens connections one way: the other network's guests reach this one's only if that " +
					"network allows it too. The hosts themselves are never reachable from guests (but for DHCP). " +
					"Empty (the default): nothing more.",
				ElementType:   types.StringType,
				Optional:      true,
				Computed:      true,
				Default:       setdefault.StaticValue(stringSet(nil)),
				PlanModifiers: []planmodifier.Set{setplanmodifier.RequiresReplace()},
			},
			"vni": schema.Int64Attribute{
				MarkdownDescription: "`overlay` networks only: the VXLAN network identifier, 1 to 16777215, unique in the " +
					"fleet. Left out, the control plane chooses the lowest free one from 4096 up.",
				Optional:      true,
				Computed:      true,
				Validators:    []validator.Int64{int64validator.Between(1, api.OverlayMaxVNI)},
				PlanModifiers: []planmodifier.Int64{int64planmodifier.UseStateForUnknown(), int64planmodifier.RequiresReplace()},
			},
			"mtu": schema.Int64Attribute{
				MarkdownDescription: fmt.Sprintf("`overlay` networks only: the MTU of the network's guests, bridges and "+
					"tunnels, %d to %d. Defaults to %d: a 1500-byte underlay less the 50 bytes VXLAN over IPv4 adds. "+
					"It must fit the hosts' underlay: an agent whose underlay interface's MTU less 50 is smaller refuses "+
					"the network.", api.OverlayMinMTU, api.OverlayMaxMTU, api.OverlayDefaultMTU),
				Optional:      true,
				Computed:      true,
				Validators:    []validator.Int64{int64validator.Between(api.OverlayMinMTU, api.OverlayMaxMTU)},
				PlanModifiers: []planmodifier.Int64{int64planmodifier.UseStateForUnknown(), int64planmodifier.RequiresReplace()},
			},
			"addresses_total": schema.Int64Attribute{
				MarkdownDescription: "How many addresses the control plane can assign on the network (0 without a `cidr`).",
				Computed:            true,
				PlanModifiers:       []planmodifier.Int64{int64planmodifier.UseStateForUnknown()},
			},
			"addresses_used": schema.Int64Attribute{
				MarkdownDescription: "How many of them VMs hold now.",
				Computed:            true,
			},
		},
	}
}

func (r *networkResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (r *networkResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan networkModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	hosts, err := hostsFromSet(ctx, plan.Hosts)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("hosts"), summaryCreateNetwork, err.Error())
		return
	}
	allow, err := hostsFromSet(ctx, plan.Allow)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("allow"), summaryCreateNetwork, err.Error())
		return
	}
	in := api.NetworkCreate{Name: plan.Name.ValueString(), Project: r.data.project, Mode: plan.Mode.ValueString(), CIDR: plan.CIDR.ValueString(),
		Gateway: plan.Gateway.ValueString(), Bridge: plan.Bridge.ValueString(), Hosts: hosts, Allow: allow}
	if !plan.DHCP.IsNull() && !plan.DHCP.IsUnknown() {
		dhcp := plan.DHCP.ValueBool()
		in.DHCP = &dhcp
	}
	if !plan.VNI.IsNull() && !plan.VNI.IsUnknown() {
		vni := plan.VNI.ValueInt64()
		in.VNI = &vni
	}
	if !plan.MTU.IsNull() && !plan.MTU.IsUnknown() {
		mtu := plan.MTU.ValueInt64()
		in.MTU = &mtu
	}
	n, err := r.data.client.CreateNetwork(ctx, in)
	r.data.wrote()
	if err != nil {
		subject := fmt.Sprintf("creating network %q", in.Name)
		if errors.Is(err, client.ErrConflict) {
			resp.Diagnostics.AddError(summaryCreateNetwork, fmt.Sprintf("The control API refused network %q: its name, "+
				"cidr or vni is taken. To manage an existing network, import it: terraform import kvm_network.<name> %s; "+
				"otherwise choose another name, a cidr that does not overlap, or another vni.\n\nError: %s", in.Name, in.Name, err))
			return
		}
		addCreateInProjectError(&resp.Diagnostics, summaryCreateNetwork, subject, in.Project, err)
		return
	}
	tflog.Info(ctx, "created network", map[string]any{"name": n.Name, "project": n.Project, "mode": n.Mode, "cidr": n.CIDR})
	plan.fromAPI(n)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *networkResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state networkModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	n, err := r.data.client.GetNetwork(ctx, name)
	if errors.Is(err, client.ErrNotFound) {
		tflog.Info(ctx, "network is gone from the control API; removing it from state", map[string]any{"name": name})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadNetwork, fmt.Sprintf("reading network %q", name), err)
		return
	}
	state.fromAPI(n)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *networkResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan networkModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := plan.Name.ValueString()
	hosts, err := hostsFromSet(ctx, plan.Hosts)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("hosts"), summaryUpdateNetwork, err.Error())
		return
	}
	n, err := r.data.client.UpdateNetwork(ctx, name, api.NetworkPatch{Hosts: &hosts})
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateNetwork, fmt.Sprintf("updating network %q", name), err)
		return
	}
	plan.fromAPI(n)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *networkResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state networkModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := state.Name.ValueString()
	err := r.data.client.DeleteNetwork(ctx, name)
	r.data.wrote()
	addDeleteError(&resp.Diagnostics, summaryDeleteNetwork, fmt.Sprintf("deleting network %q", name), err, fmt.Sprintf(
		"Network %q still has NICs of VMs, so the control API keeps it. Delete those VMs first (a kvm_vm whose "+
			"network_interface names kvm_network.<name>.name is destroyed before the network), then run "+
			"terraform destroy again.", name))
}

func (r *networkResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	resource.ImportStatePassthroughID(ctx, path.Root("name"), req, resp)
}
