package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// The console sizes the control API serves: its default and its maximum.
const (
	defaultConsoleBytes = 64 << 10
	maxConsoleBytes     = 1 << 20
)

var (
	_ datasource.DataSource              = (*vmConsoleDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*vmConsoleDataSource)(nil)
)

// NewVMConsoleDataSource is the kvm_vm_console data source.
func NewVMConsoleDataSource() datasource.DataSource { return &vmConsoleDataSource{} }

type vmConsoleDataSource struct {
	data *providerData
}

type vmConsoleModel struct {
	VMID   types.String `tfsdk:"vm_id"`
	Bytes  types.Int64  `tfsdk:"bytes"`
	Output types.String `tfsdk:"output"`
}

func (d *vmConsoleDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_vm_console"
}

func (d *vmConsoleDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "The tail of a VM's serial console, read through the control API " +
			"(`GET /v1/vms/{id}/console`) from the VM's host: the boot messages, cloud-init's progress, and what " +
			"the guest prints there (the busybox image prints its addresses, hostname and the SHA-256 of the user " +
			"data it read). It is read at every refresh, so it shows the console at that moment.",
		Attributes: map[string]schema.Attribute{
			"vm_id": schema.StringAttribute{
				MarkdownDescription: "ID of the VM (`kvm_vm.<name>.id`).",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"bytes": schema.Int64Attribute{
				MarkdownDescription: fmt.Sprintf("How many bytes of the console's end to read: at most %d (1 MiB); "+
					"default %d (64 KiB).", maxConsoleBytes, defaultConsoleBytes),
				Optional:   true,
				Validators: []validator.Int64{int64validator.Between(1, maxConsoleBytes)},
			},
			"output": schema.StringAttribute{
				MarkdownDescription: "The console text, the last `bytes` bytes of it (the first line may be cut).",
				Computed:            true,
			},
		},
	}
}

func (d *vmConsoleDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *vmConsoleDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m vmConsoleModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := m.VMID.ValueString()
	n := m.Bytes.ValueInt64()
	if m.Bytes.IsNull() {
		n = defaultConsoleBytes
	}
	out, err := d.data.client.VMConsole(ctx, id, n)
	if errors.Is(err, client.ErrNotFound) {
		resp.Diagnostics.AddAttributeError(path.Root("vm_id"), summaryReadConsole, fmt.Sprintf(
			"No VM with id %s: check the id, or create the VM first.\n\nError: %s", id, err))
		return
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryReadConsole, fmt.Sprintf("reading the serial console of VM %s", id), err)
		return
	}
	m.Output = types.StringValue(out)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}
