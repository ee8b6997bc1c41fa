package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ datasource.DataSource              = (*projectDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*projectDataSource)(nil)
)

// NewProjectDataSource is the kvm_project data source.
func NewProjectDataSource() datasource.DataSource { return &projectDataSource{} }

type projectDataSource struct {
	data *providerData
}

func (d *projectDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_project"
}

func (d *projectDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	amounts := func(vcpus, memory, disk, vms string) map[string]schema.Attribute {
		return map[string]schema.Attribute{
			api.ResourceVCPUs:     schema.Int64Attribute{MarkdownDescription: vcpus, Computed: true},
			api.ResourceMemoryMiB: schema.Int64Attribute{MarkdownDescription: memory, Computed: true},
			api.ResourceDiskMiB:   schema.Int64Attribute{MarkdownDescription: disk, Computed: true},
			api.ResourceVMs:       schema.Int64Attribute{MarkdownDescription: vms, Computed: true},
		}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one project: its quotas and what its VMs hold now (`usage`), for example to " +
			"check the room left before creating VMs. An admin token reads any project, a project token its own " +
			"only (any other reads as not found).",
		Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the project to read, for example `default`.",
				Required:            true,
				Validators:          []validator.String{projectNameValidator()},
			},
			"id":          schema.StringAttribute{MarkdownDescription: "The project's name.", Computed: true},
			"description": schema.StringAttribute{MarkdownDescription: "Free text for people.", Computed: true},
			"quotas": schema.SingleNestedAttribute{
				MarkdownDescription: "The project's limits; a null limit is unlimited.",
				Computed:            true,
				Attributes: amounts("Virtual CPUs the project's VMs may hold at once; null is unlimited.",
					"MiB of memory the project's VMs may hold at once; null is unlimited.",
					"MiB of disk the project's VMs may hold at once; null is unlimited.",
					"VMs the project may have at once; null is unlimited."),
			},
			"host_labels": schema.MapAttribute{
				MarkdownDescription: "Labels a host must all have to run the project's VMs; empty for any host.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"usage": schema.SingleNestedAttribute{
				MarkdownDescription: "What the project's VMs hold now.",
				Computed:            true,
				Attributes: amounts("Virtual CPUs the project's VMs hold now.", "MiB of memory the project's VMs hold now.",
					"MiB of disk the project's VMs hold now.", "VMs of the project that hold capacity on a host now."),
			},
			"created_at": schema.StringAttribute{MarkdownDescription: "When the project was created (RFC 3339, UTC).", Computed: true},
		},
	}
}

func (d *projectDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *projectDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg projectModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	name := cfg.Name.ValueString()
	p, err := d.data.client.GetProject(ctx, name)
	if errors.Is(err, client.ErrNotFound) {
		resp.Diagnostics.AddAttributeError(path.Root("name"), summaryReadProject, fmt.Sprintf(
			"No such project: the control API has no project %q that this token may read (a project token reads only "+
				"its own). Check the name and the provider's token.\n\nError: %s", name, err))
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadProject, fmt.Sprintf("reading project %q", name), err)
		return
	}
	cfg.fromAPI(p)
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
