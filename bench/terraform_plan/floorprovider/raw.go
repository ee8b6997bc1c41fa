package main

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
)

// rawServer serves <typeName>_vm on tfprotov6 directly, without the
// framework: the cost of terraform core over kvm_vm's schema with a provider
// that costs next to nothing. Every RPC a plan, apply, import or destroy of
// the resource makes is answered here; the embedded framework server only
// fills in the RPCs Terraform never sends to this provider (data sources,
// functions, ephemeral resources, state moves), saving a page of stubs.
type rawServer struct {
	tfprotov6.ProviderServer

	typeName  string
	metadata  *tfprotov6.GetMetadataResponse
	schema    *tfprotov6.GetProviderSchemaResponse
	valueType tftypes.Type
	version   int64
	computed  map[string]bool // top-level attributes
}

var _ tfprotov6.ProviderServer = (*rawServer)(nil)

// newRawServer asks the framework server for its metadata and schema once,
// so both modes serve the same schema and it has one source.
func newRawServer(ctx context.Context, framework tfprotov6.ProviderServer, typeName string) (*rawServer, error) {
	metadata, err := framework.GetMetadata(ctx, &tfprotov6.GetMetadataRequest{})
	if err != nil {
		return nil, err
	}
	schema, err := framework.GetProviderSchema(ctx, &tfprotov6.GetProviderSchemaRequest{})
	if err != nil {
		return nil, err
	}
	for _, d := range append(metadata.Diagnostics, schema.Diagnostics...) {
		if d.Severity == tfprotov6.DiagnosticSeverityError {
			return nil, fmt.Errorf("schema of the framework provider: %s: %s", d.Summary, d.Detail)
		}
	}
	res, ok := schema.ResourceSchemas[typeName]
	if !ok {
		return nil, fmt.Errorf("the framework provider has no resource %s", typeName)
	}
	computed := map[string]bool{}
	for _, a := range res.Block.Attributes {
		computed[a.Name] = a.Computed
	}
	return &rawServer{
		ProviderServer: framework, typeName: typeName, metadata: metadata, schema: schema,
		valueType: res.ValueType(), version: res.Version, computed: computed,
	}, nil
}

func (s *rawServer) GetMetadata(context.Context, *tfprotov6.GetMetadataRequest) (*tfprotov6.GetMetadataResponse, error) {
	return s.metadata, nil
}

func (s *rawServer) GetProviderSchema(context.Context, *tfprotov6.GetProviderSchemaRequest) (*tfprotov6.GetProviderSchemaResponse, error) {
	return s.schema, nil
}

func (s *rawServer) GetResourceIdentitySchemas(context.Context, *tfprotov6.GetResourceIdentitySchemasRequest) (*tfprotov6.GetResourceIdentitySchemasResponse, error) {
	return &tfprotov6.GetResourceIdentitySchemasResponse{IdentitySchemas: map[string]*tfprotov6.ResourceIdentitySchema{}}, nil
}

func (s *rawServer) ValidateProviderConfig(_ context.Context, req *tfprotov6.ValidateProviderConfigRequest) (*tfprotov6.ValidateProviderConfigResponse, error) {
	return &tfprotov6.ValidateProviderConfigResponse{PreparedConfig: req.Config}, nil
}

func (s *rawServer) ConfigureProvider(context.Context, *tfprotov6.ConfigureProviderRequest) (*tfprotov6.ConfigureProviderResponse, error) {
	return &tfprotov6.ConfigureProviderResponse{}, nil
}

func (s *rawServer) StopProvider(context.Context, *tfprotov6.StopProviderRequest) (*tfprotov6.StopProviderResponse, error) {
	return &tfprotov6.StopProviderResponse{}, nil
}

func (s *rawServer) ValidateResourceConfig(_ context.Context, req *tfprotov6.ValidateResourceConfigRequest) (*tfprotov6.ValidateResourceConfigResponse, error) {
	return &tfprotov6.ValidateResourceConfigResponse{Diagnostics: s.checkType(req.TypeName)}, nil
}

// UpgradeResourceState only accepts state of the schema's current version,
// which it decodes from JSON and returns as is: there are no upgrades.
func (s *rawServer) UpgradeResourceState(_ context.Context, req *tfprotov6.UpgradeResourceStateRequest) (*tfprotov6.UpgradeResourceStateResponse, error) {
	if d := s.checkType(req.TypeName); d != nil {
		return &tfprotov6.UpgradeResourceStateResponse{Diagnostics: d}, nil
	}
	if req.Version != s.version || req.RawState == nil || req.RawState.JSON == nil {
		return &tfprotov6.UpgradeResourceStateResponse{Diagnostics: errorDiag("Unable to Upgrade Resource State",
			fmt.Errorf("want JSON state of schema version %d, got version %d", s.version, req.Version))}, nil
	}
	v, err := req.RawState.UnmarshalWithOpts(s.valueType, tfprotov6.UnmarshalOpts{
		ValueFromJSONOpts: tftypes.ValueFromJSONOpts{IgnoreUndefinedAttributes: true},
	})
	if err != nil {
		return &tfprotov6.UpgradeResourceStateResponse{Diagnostics: errorDiag("Unable to Upgrade Resource State", err)}, nil
	}
	state, diags := s.dynamicValue(v)
	return &tfprotov6.UpgradeResourceStateResponse{UpgradedState: state, Diagnostics: diags}, nil
}

// ReadResource finds the resource exactly as the prior state says.
func (s *rawServer) ReadResource(_ context.Context, req *tfprotov6.ReadResourceRequest) (*tfprotov6.ReadResourceResponse, error) {
	return &tfprotov6.ReadResourceResponse{NewState: req.CurrentState, Private: req.Private, Diagnostics: s.checkType(req.TypeName)}, nil
}

// PlanResourceChange plans Terraform's proposed new state, except that on
// create the computed attributes the configuration leaves out become unknown
// (known after apply), as a real provider's would.
func (s *rawServer) PlanResourceChange(_ context.Context, req *tfprotov6.PlanResourceChangeRequest) (*tfprotov6.PlanResourceChangeResponse, error) {
	if d := s.checkType(req.TypeName); d != nil {
		return &tfprotov6.PlanResourceChangeResponse{Diagnostics: d}, nil
	}
	if !isNull(req.PriorState) || isNull(req.ProposedNewState) {
		return &tfprotov6.PlanResourceChangeResponse{PlannedState: req.ProposedNewState, PlannedPrivate: req.PriorPrivate}, nil
	}
	proposed, err := req.ProposedNewState.Unmarshal(s.valueType)
	if err != nil {
		return &tfprotov6.PlanResourceChangeResponse{Diagnostics: errorDiag("Unable to Plan Resource Change", err)}, nil
	}
	planned, err := tftypes.Transform(proposed, func(p *tftypes.AttributePath, v tftypes.Value) (tftypes.Value, error) {
		if steps := p.Steps(); len(steps) == 1 && v.IsNull() && s.computed[string(steps[0].(tftypes.AttributeName))] {
			return tftypes.NewValue(v.Type(), tftypes.UnknownValue), nil
		}
		return v, nil
	})
	if err != nil {
		return &tfprotov6.PlanResourceChangeResponse{Diagnostics: errorDiag("Unable to Plan Resource Change", err)}, nil
	}
	state, diags := s.dynamicValue(planned)
	return &tfprotov6.PlanResourceChangeResponse{PlannedState: state, Diagnostics: diags}, nil
}

// ApplyResourceChange does nothing but give unknowns fixed values; a destroy
// is planned as null and applied as planned.
func (s *rawServer) ApplyResourceChange(_ context.Context, req *tfprotov6.ApplyResourceChangeRequest) (*tfprotov6.ApplyResourceChangeResponse, error) {
	if d := s.checkType(req.TypeName); d != nil {
		return &tfprotov6.ApplyResourceChangeResponse{Diagnostics: d}, nil
	}
	if isNull(req.PlannedState) {
		return &tfprotov6.ApplyResourceChangeResponse{NewState: req.PlannedState}, nil
	}
	planned, err := req.PlannedState.Unmarshal(s.valueType)
	if err == nil {
		planned, err = withKnownValues(planned)
	}
	if err != nil {
		return &tfprotov6.ApplyResourceChangeResponse{Diagnostics: errorDiag("Unable to Apply Resource Change", err)}, nil
	}
	state, diags := s.dynamicValue(planned)
	return &tfprotov6.ApplyResourceChangeResponse{NewState: state, Private: req.PlannedPrivate, Diagnostics: diags}, nil
}

// ImportResourceState imports a state with the given id and every other
// attribute null; the refresh after it returns that state unchanged.
func (s *rawServer) ImportResourceState(_ context.Context, req *tfprotov6.ImportResourceStateRequest) (*tfprotov6.ImportResourceStateResponse, error) {
	if d := s.checkType(req.TypeName); d != nil {
		return &tfprotov6.ImportResourceStateResponse{Diagnostics: d}, nil
	}
	attrs := map[string]tftypes.Value{}
	for name, t := range s.valueType.(tftypes.Object).AttributeTypes {
		attrs[name] = tftypes.NewValue(t, nil)
	}
	attrs["id"] = tftypes.NewValue(tftypes.String, req.ID)
	state, diags := s.dynamicValue(tftypes.NewValue(s.valueType, attrs))
	if diags != nil {
		return &tfprotov6.ImportResourceStateResponse{Diagnostics: diags}, nil
	}
	return &tfprotov6.ImportResourceStateResponse{
		ImportedResources: []*tfprotov6.ImportedResource{{TypeName: req.TypeName, State: state}},
	}, nil
}

func (s *rawServer) checkType(name string) []*tfprotov6.Diagnostic {
	if name == s.typeName {
		return nil
	}
	return errorDiag("Unknown Resource Type", fmt.Errorf("this provider has only %s, not %s", s.typeName, name))
}

func (s *rawServer) dynamicValue(v tftypes.Value) (*tfprotov6.DynamicValue, []*tfprotov6.Diagnostic) {
	dv, err := tfprotov6.NewDynamicValue(s.valueType, v)
	if err != nil {
		return nil, errorDiag("Unable to Encode State", err)
	}
	return &dv, nil
}

// isNull tells a null object (no prior state on create, no new state on
// destroy) without decoding it: Terraform core sends msgpack, where null is
// the single byte 0xc0. Decoding every state twice would inflate the floor.
func isNull(v *tfprotov6.DynamicValue) bool {
	return v == nil || (len(v.MsgPack) == 1 && v.MsgPack[0] == 0xc0)
}

func errorDiag(summary string, err error) []*tfprotov6.Diagnostic {
	return []*tfprotov6.Diagnostic{{Severity: tfprotov6.DiagnosticSeverityError, Summary: summary, Detail: err.Error()}}
}
