package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/datasourcevalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"
)

var (
	_ datasource.DataSource                     = (*volumeDataSource)(nil)
	_ datasource.DataSourceWithConfigure        = (*volumeDataSource)(nil)
	_ datasource.DataSourceWithConfigValidators = (*volumeDataSource)(nil)
)

// NewVolumeDataSource is the kvm_volume data source.
func NewVolumeDataSource() datasource.DataSource { return &volumeDataSource{} }

type volumeDataSource struct {
	data *providerData
}

func (d *volumeDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_volume"
}

func (d *volumeDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	computed := func(description string) schema.StringAttribute {
		return schema.StringAttribute{MarkdownDescription: description, Computed: true}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one volume of the project by `id` or `name`: its host, size, device path and the VMs that have it.",
		Attributes: map[string]schema.Attribute{
			"id":       schema.StringAttribute{MarkdownDescription: "Id of the volume to read (or give `name`).", Optional: true, Computed: true},
			"name":     schema.StringAttribute{MarkdownDescription: "Name of the volume to read (or give `id`).", Optional: true, Computed: true},
			"project":  computed("Project of the volume."),
			"size_mib": schema.Int64Attribute{MarkdownDescription: "Size in MiB.", Computed: true},
			"host":     computed("Host the volume lives on."),
			"source": schema.SingleNestedAttribute{
				MarkdownDescription: "What the volume was made from (null: an empty disk).",
				Computed:            true,
				Attributes: map[string]schema.Attribute{
					"image":  computed("The image it was made from."),
					"volume": computed("Id of the volume it was cloned from."),
				},
			},
			"labels":      schema.MapAttribute{MarkdownDescription: "Labels of the volume.", ElementType: types.StringType, Computed: true},
			"state":       computed("`creating`, `ready`, `moving` (to another host), `deleting` or `error`."),
			"serial":      computed("Serial the guest sees the disk by."),
			"device":      computed("Stable path of the disk in a guest: `/dev/disk/by-id/virtio-<serial>`."),
			"attached_to": schema.ListAttribute{MarkdownDescription: "Ids of the VMs that have it attached.", ElementType: types.StringType, Computed: true},
		},
	}
}

func (d *volumeDataSource) ConfigValidators(context.Context) []datasource.ConfigValidator {
	return []datasource.ConfigValidator{datasourcevalidator.ExactlyOneOf(path.MatchRoot("id"), path.MatchRoot("name"))}
}

func (d *volumeDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *volumeDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg volumeModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	ref := cfg.ID.ValueString()
	if ref == "" {
		ref = cfg.Name.ValueString()
	}
	v, err := d.data.client.GetVolume(ctx, ref)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadVolume, fmt.Sprintf("reading volume %q", ref), err)
		return
	}
	cfg.Source = types.ObjectNull(volumeSourceTypes)
	cfg.fromAPI(v)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
