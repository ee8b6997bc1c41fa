package provider

import (
	"context"
	"slices"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

var (
	_ datasource.DataSource              = (*hostsDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*hostsDataSource)(nil)
)

// NewHostsDataSource is the kvm_hosts data source.
func NewHostsDataSource() datasource.DataSource { return &hostsDataSource{} }

type hostsDataSource struct {
	data *providerData
}

type hostsDataModel struct {
	Labels types.Map       `tfsdk:"labels"`
	Names  types.List      `tfsdk:"names"`
	Hosts  []hostDataModel `tfsdk:"hosts"`
}

func (d *hostsDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_hosts"
}

func (d *hostsDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Lists the registered hosts, sorted by name, optionally only those that carry given labels.",
		Attributes: map[string]schema.Attribute{
			"labels": schema.MapAttribute{
				MarkdownDescription: "Only hosts that carry every one of these labels with the same value.",
				ElementType:         types.StringType,
				Optional:            true,
			},
			"names": schema.ListAttribute{
				MarkdownDescription: "Names of the hosts, sorted.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"hosts": schema.ListNestedAttribute{
				MarkdownDescription: "The hosts, in the order of `names`.",
				Computed:            true,
				NestedObject:        schema.NestedAttributeObject{Attributes: hostDataAttributes()},
			},
		},
	}
}

func (d *hostsDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *hostsDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg hostsDataModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	want, diags := labelsFromValue(ctx, cfg.Labels)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	hosts, err := d.data.client.AllHosts(ctx)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadHosts, "listing hosts", err)
		return
	}
	names := []string{}
	cfg.Hosts = []hostDataModel{}
	for _, h := range sortedHosts(hosts) {
		if !hasLabels(h.Labels, want) {
			continue
		}
		var m hostDataModel
		m.fromAPI(h)
		cfg.Hosts = append(cfg.Hosts, m)
		names = append(names, h.Name)
	}
	cfg.Names = stringList(names)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}

func sortedHosts(hosts []api.Host) []api.Host {
	out := slices.Clone(hosts)
	slices.SortFunc(out, func(a, b api.Host) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if got, ok := have[k]; !ok || got != v {
			return false
		}
	}
	return true
}
