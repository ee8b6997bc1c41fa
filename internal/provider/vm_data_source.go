package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/datasourcevalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ datasource.DataSource                     = (*vmDataSource)(nil)
	_ datasource.DataSourceWithConfigure        = (*vmDataSource)(nil)
	_ datasource.DataSourceWithConfigValidators = (*vmDataSource)(nil)
)

// NewVMDataSource is the kvm_vm data source.
func NewVMDataSource() datasource.DataSource { return &vmDataSource{} }

type vmDataSource struct {
	data *providerData
}

func (d *vmDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_vm"
}

func (d *vmDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	computed := func(description string) schema.StringAttribute {
		return schema.StringAttribute{MarkdownDescription: description, Computed: true}
	}
	computedInt := func(description string) schema.Int64Attribute {
		return schema.Int64Attribute{MarkdownDescription: description, Computed: true}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one VM by `id` or by `name` (exactly one of them): its shape, host, desired and " +
			"observed state and placement.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "ID of the VM to read. Exactly one of `id` and `name` is required.",
				Optional:            true,
				Computed:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the VM to read. Exactly one of `id` and `name` is required.",
				Optional:            true,
				Computed:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"project": computed("Project the VM belongs to."),
			"image":   computed("Guest image the VM booted."),
			"secure_boot": schema.BoolAttribute{MarkdownDescription: "Whether the VM boots with UEFI Secure Boot.",
				Computed: true},
			"vcpus":      computedInt("Number of virtual CPUs."),
			"memory_mib": computedInt("Memory in MiB."),
			"disk_mib":   computedInt("Disk size in MiB."),
			"host":       computed("Host the VM is placed on."),
			"power_state": computed("Power state as observed on the host when it is definite (`running` or " +
				"`stopped`), else the desired one."),
			"labels": schema.MapAttribute{
				MarkdownDescription: "Labels of the VM.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"observed_state": computed("State the control API last observed on the host: `creating`, `running`, " +
				"`paused`, `stopped`, `error`, `missing`, `lost` or `unknown`."),
			"started_from": computed("How the VM was started: `cold`, `warm` or `snapshot`."),
			"placement_score": schema.Float64Attribute{
				MarkdownDescription: "Score of the chosen host at placement time (lower is better), to a multiple of 1/1024 " +
					"(about three decimals; `placement_summary` shows five).",
				Computed: true,
			},
			"placement_summary": computed("One line on the placement: the chosen host, its score, and why other " +
				"hosts were rejected."),
			"created_at": computed("When the VM was created (RFC 3339, UTC)."),
			"ipv4_address": computed("Address of the VM's first NIC (`10.0.2.15` on a user-mode network, where " +
				"the VM is reached through port forwards); null while unknown."),
			"constraints": constraintsComputedAttribute(),
			"ssh_authorized_keys": schema.ListAttribute{
				MarkdownDescription: "OpenSSH public keys the VM's seed gives its guest.",
				ElementType:         types.StringType,
				Computed:            true,
			},
			"meta_data": schema.MapAttribute{
				MarkdownDescription: "Extra NoCloud meta-data keys the VM was created with (those the product sets, " +
					"`instance-id` and `public-keys`, are not listed).",
				ElementType: types.StringType,
				Computed:    true,
			},
			"network_config": computed("Cloud-init network configuration the VM was created with; null when it is " +
				"generated from the VM's NICs."),
			"hostname": computed("The guest's hostname as its seed gives it; null for a VM without guest configuration."),
			"user_data_sha256": computed("Hex SHA-256 of the VM's user data; null without user data (the user data " +
				"itself is never returned)."),
			"constraints_violated": computed("How the VM's host no longer meets its constraints (its labels changed " +
				"after placement); empty when they hold. The VM is never moved for it."),
		},
	}
}

func (d *vmDataSource) ConfigValidators(context.Context) []datasource.ConfigValidator {
	return []datasource.ConfigValidator{
		datasourcevalidator.ExactlyOneOf(path.MatchRoot("id"), path.MatchRoot("name")),
	}
}

func (d *vmDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *vmDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg vmAttributes
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	var (
		vm      api.VM
		err     error
		subject string
		attr    path.Path
	)
	if id := cfg.ID.ValueString(); id != "" {
		subject, attr = fmt.Sprintf("reading VM %s", id), path.Root("id")
		vm, err = d.data.getVM(ctx, id)
	} else {
		name := cfg.Name.ValueString()
		subject, attr = fmt.Sprintf("finding the VM named %q", name), path.Root("name")
		vm, err = findVMByName(ctx, d.data.client, d.data.project, name)
	}
	if errors.Is(err, client.ErrNotFound) {
		resp.Diagnostics.AddAttributeError(attr, summaryReadVM, fmt.Sprintf(
			"No such VM: the control API found nothing %s. Check the value, or create the VM first.\n\nError: %s",
			subject, err))
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadVM, subject, err)
		return
	}
	cfg.fromAPI(vm, observedPowerState(vm))
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}
