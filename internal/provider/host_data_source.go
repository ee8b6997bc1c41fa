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
	_ datasource.DataSource              = (*hostDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*hostDataSource)(nil)
)

// NewHostDataSource is the kvm_host data source.
func NewHostDataSource() datasource.DataSource { return &hostDataSource{} }

type hostDataSource struct {
	data *providerData
}

// hostDataAttributes are the attributes of one host in the kvm_host and
// kvm_hosts data sources, all computed.
func hostDataAttributes() map[string]schema.Attribute {
	res := func(description string) schema.SingleNestedAttribute {
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
	return map[string]schema.Attribute{
		"name":             schema.StringAttribute{MarkdownDescription: "Name of the host.", Computed: true},
		"address":          schema.StringAttribute{MarkdownDescription: "Address of the host agent's API, `scheme://host:port` (hosts registered before addresses needed a scheme may show `host:port`).", Computed: true},
		"underlay_address": schema.StringAttribute{MarkdownDescription: "IPv4 address the host's overlay tunnels run from; null without one.", Computed: true},
		"labels": schema.MapAttribute{
			MarkdownDescription: "Labels of the host.",
			ElementType:         types.StringType,
			Computed:            true,
		},
		"schedulable": schema.BoolAttribute{
			MarkdownDescription: "Whether new VMs may be placed on the host.",
			Computed:            true,
		},
		"cpu_allocation_ratio": schema.Float64Attribute{
			MarkdownDescription: "How many vCPUs may be allocated per physical CPU.",
			Computed:            true,
		},
		"memory_reserved_mib": schema.Int64Attribute{
			MarkdownDescription: "Memory in MiB kept back for the host itself.",
			Computed:            true,
		},
		"capacity":  res("What the host can allocate to VMs: (total - reserved) x allocation ratio."),
		"allocated": res("What the VMs placed on the host have reserved."),
		"free":      res("Capacity minus allocated and warm."),
		"warm":      res("What the host's warm pool holds (ready and booting warm VMs); the host's agent evicts warm VMs when a new VM needs their share."),
		"isolation": schema.StringAttribute{
			MarkdownDescription: "How the host's agent holds each VM to its shape: `cgroup v2: ...` (memory and CPU limits per VM), or `none: <why>`.",
			Computed:            true,
		},
		"retired": schema.BoolAttribute{
			MarkdownDescription: "Whether the host was retired (its agent gone for good; its VMs lost).",
			Computed:            true,
		},
		"retired_at": schema.StringAttribute{
			MarkdownDescription: "When the host was retired (RFC 3339, UTC); null while it is in service.",
			Computed:            true,
		},
		"drain": schema.BoolAttribute{
			MarkdownDescription: "Whether the host is drained or draining (it takes no new VM; its VMs are migrated off it).",
			Computed:            true,
		},
		"drain_status": drainStatusDataAttribute(),
		"alive": schema.BoolAttribute{
			MarkdownDescription: "Whether the host agent answered the control API's last check.",
			Computed:            true,
		},
		"last_seen": schema.StringAttribute{
			MarkdownDescription: "When the host agent last answered (RFC 3339, UTC); null if it never did.",
			Computed:            true,
		},
		"accel": schema.StringAttribute{
			MarkdownDescription: "Accelerator the agent runs guests with: `kvm` or `tcg`.",
			Computed:            true,
		},
		"driver": schema.StringAttribute{
			MarkdownDescription: "VMM driver of the agent: `qemu` or `sim`.",
			Computed:            true,
		},
		"images": schema.ListAttribute{
			MarkdownDescription: "Guest images the host offers.",
			ElementType:         types.StringType,
			Computed:            true,
		},
		"warm_pool": warmPoolDataAttribute(),
	}
}

func (d *hostDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_host"
}

func (d *hostDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	attrs := hostDataAttributes()
	attrs["name"] = schema.StringAttribute{
		MarkdownDescription: "Name of the host to read.",
		Required:            true,
		Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one registered host: its settings, capacity, allocation, liveness and images.",
		Attributes:          attrs,
	}
}

func (d *hostDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *hostDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg hostDataModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := cfg.Name.ValueString()
	h, err := d.data.client.GetHost(ctx, name)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadHost, fmt.Sprintf("reading host %q", name), err)
		return
	}
	cfg.fromAPI(h)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
