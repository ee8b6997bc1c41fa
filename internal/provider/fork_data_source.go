package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ datasource.DataSource              = (*forkDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*forkDataSource)(nil)
)

// NewForkDataSource is the kvm_fork data source.
func NewForkDataSource() datasource.DataSource { return &forkDataSource{} }

type forkDataSource struct {
	data *providerData
}

func (d *forkDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_fork"
}

func (d *forkDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	computed := func(description string) schema.StringAttribute {
		return schema.StringAttribute{MarkdownDescription: description, Computed: true}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one fork by `id`: its source, the snapshot its children start from, the phase of " +
			"its last pass and its children.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "ID of the fork to read.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"source_vm_id": computed("ID of the VM that was forked."),
			"child_count": schema.Int64Attribute{
				MarkdownDescription: "Number of children asked for (`children` lists those that exist).",
				Computed:            true,
			},
			"pause_source": schema.BoolAttribute{
				MarkdownDescription: "Whether the source was left paused after the snapshot.",
				Computed:            true,
			},
			"placement":   computed("`colocate` or `spread`."),
			"snapshot_id": computed("ID of the one snapshot every child starts from."),
			"phase": computed("Phase of the fork's last pass: `pending`, `snapshotting`, `spawning`, `ready`, `retrying` " +
				"(the pass failed; the control API runs it again a few times by itself) or `failed` (terminal until an apply resumes it)."),
			"children": schema.ListNestedAttribute{
				MarkdownDescription: "The children, in slot order (child `i` is named `<fork id>-<i>`).",
				Computed:            true,
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"id":           computed("ID of the child VM."),
					"name":         computed("Name of the child VM, `<fork id>-<slot>`."),
					"project":      computed("Project of the child: its source VM's."),
					"host":         computed("Host the child runs on."),
					"ipv4_address": computed("Address of the child's first NIC."),
					"guest_ipv4_address": computed("On a `nat` network, the address the child's guest has inside on its " +
						"first NIC (the source's at the fork point; inside the child it names the child itself). Null on other networks."),
					"observed_state": computed("State the control API last observed on the child's host (see `kvm_vm`)."),
					"volume_ids": schema.ListAttribute{
						MarkdownDescription: "IDs of the child's volumes: a clone of each read-write volume of the source " +
							"as it was at the fork, the source's own read-only volumes (shared).",
						ElementType: types.StringType,
						Computed:    true,
					},
				}},
			},
			"created_at": computed("When the fork was created (RFC 3339, UTC)."),
			"constraints": func() schema.SingleNestedAttribute {
				a := constraintsComputedAttribute()
				a.MarkdownDescription = "The children's placement constraints; null when there are none."
				return a
			}(),
		},
	}
}

func (d *forkDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *forkDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg forkAttributes
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := cfg.ID.ValueString()
	f, err := d.data.client.GetFork(ctx, id)
	if errors.Is(err, client.ErrNotFound) {
		resp.Diagnostics.AddAttributeError(path.Root("id"), summaryReadFork, fmt.Sprintf(
			"No such fork: the control API has no fork %s. Check the id, or create the fork first.\n\nError: %s", id, err))
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadFork, fmt.Sprintf("reading fork %s", id), err)
		return
	}
	cfg.fromAPI(f)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
