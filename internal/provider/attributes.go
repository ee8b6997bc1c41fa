package provider

// Conversions between API values and framework attribute values that several
// resources and data sources share.

import (
	"context"
	"fmt"
	"math"
	"reflect"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// resourcesAttrTypes is the object type of capacity, allocated and free.
var resourcesAttrTypes = map[string]attr.Type{
	"vcpus":      types.Int64Type,
	"memory_mib": types.Int64Type,
	"disk_mib":   types.Int64Type,
}

// resourcesObject is a capacity, allocation or free amount as an object.
func resourcesObject(r api.Resources) types.Object {
	return types.ObjectValueMust(resourcesAttrTypes, map[string]attr.Value{
		"vcpus":      types.Int64Value(r.VCPUs),
		"memory_mib": types.Int64Value(r.MemoryMiB),
		"disk_mib":   types.Int64Value(r.DiskMiB),
	})
}

// labelsValue turns API labels into a map value; no labels is an empty map,
// the schema default, so an unlabelled object never shows a diff.
func labelsValue(labels map[string]string) types.Map {
	elems := make(map[string]attr.Value, len(labels))
	for k, v := range labels {
		elems[k] = types.StringValue(v)
	}
	return types.MapValueMust(types.StringType, elems)
}

// labelsFromValue reads a labels map; null or unknown is none.
func labelsFromValue(ctx context.Context, v types.Map) (map[string]string, diag.Diagnostics) {
	out := map[string]string{}
	if v.IsNull() || v.IsUnknown() {
		return out, nil
	}
	diags := v.ElementsAs(ctx, &out, false)
	return out, diags
}

// stringList is a list of strings; none is an empty list.
func stringList(items []string) types.List {
	elems := make([]attr.Value, len(items))
	for i, s := range items {
		elems[i] = types.StringValue(s)
	}
	return types.ListValueMust(types.StringType, elems)
}

// optionalString maps the API's "not set" (empty string) to null.
func optionalString(s string) types.String {
	if s == "" {
		return types.StringNull()
	}
	return types.StringValue(s)
}

// timestamp renders times at second precision in UTC, so a create answer
// and a later read of the same row (whose database may round differently)
// give the same string.
func timestamp(t time.Time) types.String {
	if t.IsZero() {
		return types.StringNull()
	}
	return types.StringValue(t.UTC().Truncate(time.Second).Format(time.RFC3339))
}

// stringSet is a set of strings; none is an empty set.
func stringSet(items []string) types.Set {
	elems := make([]attr.Value, len(items))
	for i, s := range items {
		elems[i] = types.StringValue(s)
	}
	return types.SetValueMust(types.StringType, elems)
}

// hostsFromSet reads a set of names (hosts, allow entries); null or unknown is none.
func hostsFromSet(ctx context.Context, v types.Set) ([]string, error) {
	out := []string{}
	if v.IsNull() || v.IsUnknown() {
		return out, nil
	}
	if diags := v.ElementsAs(ctx, &out, false); diags.HasError() {
		return nil, fmt.Errorf("read hosts: %v", diags)
	}
	return out, nil
}

// scoreStep is the grain of the placement scores the provider reports:
// 1/1024, about three decimals.
const scoreStep = 1.0 / 1024

// scoreValue is a placement score as the provider reports it, rounded to a
// multiple of scoreStep. Such a number is exact in binary and has a short
// decimal form (1.0556640625), so Terraform, which reads every number of a
// state file as a 512-bit decimal, holds it as exactly that float64: it
// crosses the plugin protocol as a float64 and back. An unrounded score
// (1.055408970976253) is not a float64 at 512 bits; it crosses as a decimal
// string that both sides print at 512-bit precision (20 us each), several
// times per resource on every plan: 0.8 s of CPU over 1,000 kvm_vm.
func scoreValue(score float64) types.Float64 {
	return types.Float64Value(math.Round(score/scoreStep) * scoreStep)
}

// hasBlocks says whether a list of blocks is known and not empty.
func hasBlocks(v types.List) bool { return !v.IsNull() && !v.IsUnknown() && len(v.Elements()) > 0 }

// sameAttributes says whether two models of the same struct type hold equal
// values in every field: each field is an attr.Value or an embedded struct of
// them. A Read that finds the state it would write equal to the prior state
// leaves the response's state alone (the framework filled it with the prior
// state) instead of encoding the whole model again.
func sameAttributes(a, b any) bool {
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	if va.Type() != vb.Type() || va.Kind() != reflect.Struct {
		return false
	}
	return sameFields(va, vb)
}

var (
	attrValueType    = reflect.TypeFor[attr.Value]()
	float64ValueType = reflect.TypeFor[types.Float64]()
)

// sameFloat64 compares as float64 values: a number read from state may
// carry more precision than a float64 (Terraform sends a decimal that a
// float64 cannot hold exactly as a string), and the float64 is what a Read
// would write.
func sameFloat64(a, b types.Float64) bool {
	if a.IsNull() || a.IsUnknown() || b.IsNull() || b.IsUnknown() {
		return a.Equal(b)
	}
	return a.ValueFloat64() == b.ValueFloat64()
}

func sameFields(a, b reflect.Value) bool {
	for i := range a.NumField() {
		fa, fb := a.Field(i), b.Field(i)
		switch {
		case fa.Type() == float64ValueType:
			if !sameFloat64(fa.Interface().(types.Float64), fb.Interface().(types.Float64)) {
				return false
			}
		case fa.Type().Implements(attrValueType):
			if !fa.Interface().(attr.Value).Equal(fb.Interface().(attr.Value)) {
				return false
			}
		case fa.Kind() == reflect.Struct && a.Type().Field(i).Anonymous:
			if !sameFields(fa, fb) {
				return false
			}
		default:
			return false // a field that is no attribute: never assume it equal
		}
	}
	return true
}

// rawBool reads a top-level bool attribute as rawString reads a string.
func rawBool(obj tftypes.Value, name string) (types.Bool, error) {
	if obj.IsNull() || !obj.IsKnown() {
		return types.BoolNull(), fmt.Errorf("reading %s: the object is null or unknown", name)
	}
	got, _, err := tftypes.WalkAttributePath(obj, tftypes.NewAttributePath().WithAttributeName(name))
	if err != nil {
		return types.BoolNull(), fmt.Errorf("reading %s: %w", name, err)
	}
	v, ok := got.(tftypes.Value)
	if !ok {
		return types.BoolNull(), fmt.Errorf("reading %s: got a %T, not a value", name, got)
	}
	b, err := types.BoolType.ValueFromTerraform(context.Background(), v)
	if err != nil {
		return types.BoolNull(), fmt.Errorf("reading %s: %w", name, err)
	}
	out, ok := b.(types.Bool)
	if !ok {
		return types.BoolNull(), fmt.Errorf("reading %s: got a %T, not a bool", name, b)
	}
	return out, nil
}

// rawString reads a top-level string attribute straight from a config, plan
// or state object, without the schema look-ups GetAttribute makes (which
// copy the schema's attribute map at every step): for the checks that run
// once per resource on every plan.
func rawString(obj tftypes.Value, name string) (types.String, error) {
	if obj.IsNull() || !obj.IsKnown() {
		return types.StringNull(), fmt.Errorf("reading %s: the object is null or unknown", name)
	}
	got, _, err := tftypes.WalkAttributePath(obj, tftypes.NewAttributePath().WithAttributeName(name))
	if err != nil {
		return types.StringNull(), fmt.Errorf("reading %s: %w", name, err)
	}
	v, ok := got.(tftypes.Value)
	if !ok {
		return types.StringNull(), fmt.Errorf("reading %s: got a %T, not a value", name, got)
	}
	s, err := types.StringType.ValueFromTerraform(context.Background(), v)
	if err != nil {
		return types.StringNull(), fmt.Errorf("reading %s: %w", name, err)
	}
	str, ok := s.(types.String)
	if !ok {
		return types.StringNull(), fmt.Errorf("reading %s: got a %T, not a string", name, s)
	}
	return str, nil
}
