package main

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/resource"

	kvmprovider "github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

var (
	_ provider.Provider                = (*floorProvider)(nil)
	_ resource.ResourceWithImportState = floorVMResource{}
)

// floorProvider is a framework provider with no configuration and a single
// resource, <typeName>_vm.
type floorProvider struct {
	typeName string
}

func (p *floorProvider) Metadata(_ context.Context, _ provider.MetadataRequest, resp *provider.MetadataResponse) {
	resp.TypeName = p.typeName
}

func (p *floorProvider) Schema(context.Context, provider.SchemaRequest, *provider.SchemaResponse) {}

func (p *floorProvider) Configure(context.Context, provider.ConfigureRequest, *provider.ConfigureResponse) {
}

func (p *floorProvider) DataSources(context.Context) []func() datasource.DataSource { return nil }

func (p *floorProvider) Resources(context.Context) []func() resource.Resource {
	return []func() resource.Resource{func() resource.Resource { return floorVMResource{} }}
}

// floorVMResource has kvm_vm's schema and does nothing: the framework's
// validation, plan modifiers, defaults and conversions are all it costs.
type floorVMResource struct{}

func (floorVMResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_vm"
}

// Schema is kvm_vm's own, called rather than copied, so the floor follows it.
func (floorVMResource) Schema(ctx context.Context, req resource.SchemaRequest, resp *resource.SchemaResponse) {
	kvmprovider.NewVMResource().Schema(ctx, req, resp)
}

func (floorVMResource) Create(_ context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	state, err := withKnownValues(req.Plan.Raw)
	if err != nil {
		resp.Diagnostics.AddError("Unable to Create floor VM", err.Error())
		return
	}
	resp.State.Raw = state
}

// Read leaves the response's state, which starts as the prior state, alone.
func (floorVMResource) Read(context.Context, resource.ReadRequest, *resource.ReadResponse) {}

func (floorVMResource) Update(_ context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	state, err := withKnownValues(req.Plan.Raw)
	if err != nil {
		resp.Diagnostics.AddError("Unable to Update floor VM", err.Error())
		return
	}
	resp.State.Raw = state
}

func (floorVMResource) Delete(context.Context, resource.DeleteRequest, *resource.DeleteResponse) {}

func (floorVMResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	resource.ImportStatePassthroughID(ctx, path.Root("id"), req, resp)
}
