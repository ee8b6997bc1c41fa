package provider

import (
	"context"
	"slices"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/listplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// maxNICs is the control API's bound on a VM's network interfaces.
const maxNICs = 8

var forwardAttrTypes = map[string]attr.Type{
	"guest_port":   types.Int64Type,
	"host_address": types.StringType,
	"host_port":    types.Int64Type,
}

var nicAttrTypes = map[string]attr.Type{
	"network":        types.StringType,
	"ipv4_address":   types.StringType,
	"mac_address":    types.StringType,
	"ipv4_addresses": types.ListType{ElemType: types.StringType},
	"port_forward":   types.ListType{ElemType: types.ObjectType{AttrTypes: forwardAttrTypes}},
}

type nicModel struct {
	Network       types.String   `tfsdk:"network"`
	IPv4Address   types.String   `tfsdk:"ipv4_address"`
	MACAddress    types.String   `tfsdk:"mac_address"`
	IPv4Addresses types.List     `tfsdk:"ipv4_addresses"`
	PortForward   []forwardModel `tfsdk:"port_forward"`
}

type forwardModel struct {
	GuestPort   types.Int64  `tfsdk:"guest_port"`
	HostAddress types.String `tfsdk:"host_address"`
	HostPort    types.Int64  `tfsdk:"host_port"`
}

// networkInterfaceBlock is kvm_vm's network_interface block. Every value in
// it is fixed at create (computed ones keep their state), and a change of
// what is configured replaces the VM: NICs are not hot-plugged.
func networkInterfaceBlock() schema.ListNestedBlock {
	fixed := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	return schema.ListNestedBlock{
		MarkdownDescription: "A network interface of the VM, in order (the first one's address is `ipv4_address`). " +
			"Without any block the VM gets one NIC on the built-in user-mode network `default`. Adding, removing or " +
			"changing a block replaces the VM.",
		Validators:    []validator.List{listvalidator.SizeAtMost(maxNICs)},
		PlanModifiers: []planmodifier.List{nicsRequireReplace()},
		NestedObject: schema.NestedBlockObject{
			Attributes: map[string]schema.Attribute{
				"network": schema.StringAttribute{
					MarkdownDescription: "Name of the network (`kvm_network`, or `default`).",
					Required:            true,
					Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
				},
				"ipv4_address": schema.StringAttribute{
					MarkdownDescription: "Address on the network. Set it to ask for a fixed address (inside the " +
						"network's `cidr`, not its gateway, and free); left out, the control plane assigns one (on " +
						"`nat` networks and `bridge` networks with a `cidr`; `10.0.2.15` on user-mode networks).",
					Optional:      true,
					Computed:      true,
					PlanModifiers: fixed,
				},
				"mac_address": schema.StringAttribute{
					MarkdownDescription: "MAC address, derived from the VM id (stable, locally administered).",
					Computed:            true,
					PlanModifiers:       fixed,
				},
				"ipv4_addresses": schema.ListAttribute{
					MarkdownDescription: "IPv4 addresses the guest reports on this NIC (matched by its MAC) through " +
						"the QEMU guest agent, for a VM with `guest_agent = true` whose guest runs " +
						"`qemu-guest-agent`: on any network mode, also a `bridge` network without a `cidr`, where the " +
						"control plane assigns none. Read at each refresh while the VM runs (and right after apply " +
						"with `wait_for = \"agent\"`); null while the guest agent does not answer.",
					ElementType: types.StringType,
					Computed:    true,
				},
			},
			Blocks: map[string]schema.Block{
				"port_forward": schema.ListNestedBlock{
					MarkdownDescription: "A guest port reachable on the host's `127.0.0.1` (user-mode networks only); " +
						"the host port is chosen by the agent and reported.",
					NestedObject: schema.NestedBlockObject{
						Attributes: map[string]schema.Attribute{
							"guest_port": schema.Int64Attribute{
								MarkdownDescription: "TCP port in the guest.",
								Required:            true,
								Validators:          []validator.Int64{int64validator.Between(1, 65535)},
							},
							"host_address": schema.StringAttribute{
								MarkdownDescription: "Address on the host the port listens on (`127.0.0.1`).",
								Computed:            true,
								PlanModifiers:       fixed,
							},
							"host_port": schema.Int64Attribute{
								MarkdownDescription: "Port on the host that reaches `guest_port`.",
								Computed:            true,
								PlanModifiers:       []planmodifier.Int64{int64planmodifier.UseStateForUnknown()},
							},
						},
					},
				},
			},
		},
	}
}

// nicsRequireReplace replaces the VM when the configured part of its NICs
// (networks, fixed addresses, forwarded guest ports) differs from state.
// It compares that part only, so a computed value that is unknown in the
// plan (an address the network does not assign) never forces a replace.
func nicsRequireReplace() planmodifier.List {
	return listplanmodifier.RequiresReplaceIf(func(ctx context.Context, req planmodifier.ListRequest, resp *listplanmodifier.RequiresReplaceIfFuncResponse) {
		cfg, d1 := nicsOf(ctx, req.ConfigValue)
		st, d2 := nicsOf(ctx, req.StateValue)
		resp.Diagnostics.Append(d1...)
		resp.Diagnostics.Append(d2...)
		resp.RequiresReplace = !configuredNICsMatch(cfg, st)
	}, "Changing network interfaces replaces the VM.", "Changing network interfaces replaces the VM.")
}

func nicsOf(ctx context.Context, v types.List) ([]nicModel, diag.Diagnostics) {
	var out []nicModel
	if v.IsNull() || v.IsUnknown() {
		return nil, nil
	}
	diags := v.ElementsAs(ctx, &out, false)
	return out, diags
}

// configuredNICsMatch says whether the configured NICs cfg are what the
// state's NICs were made from: same networks in order, a configured
// address equal to the state's, the same forwarded guest ports.
func configuredNICsMatch(cfg, state []nicModel) bool {
	if len(cfg) != len(state) {
		return false
	}
	for i, c := range cfg {
		s := state[i]
		if c.Network.ValueString() != s.Network.ValueString() {
			return false
		}
		if !c.IPv4Address.IsNull() && !c.IPv4Address.IsUnknown() && c.IPv4Address.ValueString() != s.IPv4Address.ValueString() {
			return false
		}
		if c.IPv4Address.IsUnknown() {
			return false
		}
		if !slices.EqualFunc(c.PortForward, s.PortForward, func(a, b forwardModel) bool { return a.GuestPort.Equal(b.GuestPort) }) {
			return false
		}
	}
	return true
}

// nicsToAPI is the create body's network_interfaces; nil (the API's
// default NIC) when the configuration has no block.
func nicsToAPI(nics []nicModel) []api.NetworkInterface {
	if len(nics) == 0 {
		return nil
	}
	out := make([]api.NetworkInterface, 0, len(nics))
	for _, n := range nics {
		w := api.NetworkInterface{Network: n.Network.ValueString()}
		if !n.IPv4Address.IsUnknown() {
			w.IPv4Address = n.IPv4Address.ValueString()
		}
		for _, f := range n.PortForward {
			w.PortForwards = append(w.PortForwards, api.PortForward{GuestPort: int(f.GuestPort.ValueInt64())})
		}
		out = append(out, w)
	}
	return out
}

// impliedNIC says whether the VM's NICs are what a configuration without
// network_interface blocks makes: one NIC on "default" without forwards.
func impliedNIC(nics []api.NetworkInterface) bool {
	return len(nics) == 1 && nics[0].Network == api.DefaultNetwork && len(nics[0].PortForwards) == 0
}

// nicsValue is the network_interface blocks of a VM. withBlocks says
// whether the configuration (or state) has blocks: without, a VM that only
// has the implied default NIC shows none, so there is no diff to a
// configuration without blocks (also after an import).
func nicsValue(nics []api.NetworkInterface, withBlocks bool) types.List {
	elemType := types.ObjectType{AttrTypes: nicAttrTypes}
	if !withBlocks && impliedNIC(nics) {
		return types.ListValueMust(elemType, []attr.Value{})
	}
	elems := make([]attr.Value, 0, len(nics))
	for _, n := range nics {
		fwds := make([]attr.Value, 0, len(n.PortForwards))
		for _, f := range n.PortForwards {
			hostPort := types.Int64Null()
			if f.HostPort != 0 {
				hostPort = types.Int64Value(int64(f.HostPort))
			}
			fwds = append(fwds, types.ObjectValueMust(forwardAttrTypes, map[string]attr.Value{
				"guest_port":   types.Int64Value(int64(f.GuestPort)),
				"host_address": optionalString(f.HostAddress),
				"host_port":    hostPort,
			}))
		}
		elems = append(elems, types.ObjectValueMust(nicAttrTypes, map[string]attr.Value{
			"network":        types.StringValue(n.Network),
			"ipv4_address":   optionalString(n.IPv4Address),
			"mac_address":    optionalString(n.MACAddress),
			"ipv4_addresses": guestAddresses(n.IPv4Addresses),
			"port_forward":   types.ListValueMust(types.ObjectType{AttrTypes: forwardAttrTypes}, fwds),
		}))
	}
	return types.ListValueMust(elemType, elems)
}

// guestAddresses is a NIC's ipv4_addresses: null when the guest agent
// reported none.
func guestAddresses(addrs []string) types.List {
	if len(addrs) == 0 {
		return types.ListNull(types.StringType)
	}
	return stringList(addrs)
}
