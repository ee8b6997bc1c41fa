package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
)

var (
	_ datasource.DataSource              = (*imageDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*imageDataSource)(nil)
)

// NewImageDataSource is the kvm_image data source.
func NewImageDataSource() datasource.DataSource { return &imageDataSource{} }

type imageDataSource struct {
	data *providerData
}

func (d *imageDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_image"
}

func (d *imageDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads a registered image: its source, digest, sizes and its state on each host.",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the image.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"source_url":       schema.StringAttribute{MarkdownDescription: "Where the hosts fetch the image.", Computed: true},
			"sha256":           schema.StringAttribute{MarkdownDescription: "sha256 of the file at `source_url`.", Computed: true},
			"format":           schema.StringAttribute{MarkdownDescription: "`qcow2`, `raw` or `kernel`.", Computed: true},
			"min_disk_mib":     schema.Int64Attribute{MarkdownDescription: "Smallest `disk_mib` a VM of this image may have.", Computed: true},
			"prefetch":         schema.BoolAttribute{MarkdownDescription: "Whether every host fetches the image at once.", Computed: true},
			"firmware":         schema.StringAttribute{MarkdownDescription: descImageFirmware, Computed: true},
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

func (d *imageDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *imageDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m imageModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := m.Name.ValueString()
	img, err := d.data.client.GetImage(ctx, name)
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadImage, fmt.Sprintf("reading image %q", name), err)
		return
	}
	m.fromAPI(img)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}
