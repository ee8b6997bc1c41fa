package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
)

var (
	_ datasource.DataSource              = (*networkDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*networkDataSource)(nil)
)

// NewNetworkDataSource is the kvm_network data source.
func NewNetworkDataSource() datasource.DataSource { return &networkDataSource{} }

type networkDataSource struct {
	data *providerData
}

func (d *networkDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_network"
}

func (d *networkDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	computed := func(description string) schema.StringAttribute {
		return schema.StringAttribute{MarkdownDescription: description, Computed: true}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one network, for example the built-in `default` (user mode), and how many of its " +
			"addresses VMs hold.",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the network to read.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"project": computed("Project whose VMs may attach to the network."),
			"mode":    computed("`user`, `nat`, `bridge` or `overlay`."),
			"cidr":    computed("IPv4 range the control plane assigns addresses from; null without one."),
			"gateway": computed("Gateway address inside `cidr`; null without a `cidr`."),
			"dhcp":    schema.BoolAttribute{MarkdownDescription: "Whether the agents serve addresses by DHCP.", Computed: true},
			"bridge":  computed("Existing Linux bridge of the hosts (`bridge` mode); null otherwise."),
			"hosts": schema.SetAttribute{
				MarkdownDescription: "Hosts the network is on; empty means every host.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"allow": schema.SetAttribute{
				MarkdownDescription: "What the network's guests may reach besides their own network and the outside " +
					"(`nat`): names of other `nat` networks and IPv4 CIDRs; empty for none.",
				ElementType: types.StringType,
				Computed:    true,
			},
			"vni":             schema.Int64Attribute{MarkdownDescription: "VXLAN network identifier (`overlay`); null otherwise.", Computed: true},
			"mtu":             schema.Int64Attribute{MarkdownDescription: "MTU of the guests and tunnels (`overlay`); null otherwise.", Computed: true},
			"addresses_total": schema.Int64Attribute{MarkdownDescription: "Addresses the control plane can assign.", Computed: true},
			"addresses_used":  schema.Int64Attribute{MarkdownDescription: "Addresses VMs hold now.", Computed: true},
		},
	}
}

func (d *networkDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *networkDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg networkModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := cfg.Name.ValueString()
	n, err := d.data.client.GetNetwork(ctx, name)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadNetwork, fmt.Sprintf("reading network %q", name), err)
		return
	}
	cfg.fromAPI(n)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
