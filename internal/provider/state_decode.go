package provider

import (
	"context"
	"fmt"
	"reflect"
	"sync"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
)

// A refresh reads every kvm_vm's state. tfsdk.State.Get does it by
// reflection that, on every call, builds the schema's type, parses the
// model's tags (compiling a regular expression per field) and logs each
// attribute path: on a plan over 1,000 VMs that was more CPU than the rest
// of Read. decodeState does the same conversion (each attribute through its
// schema type's ValueFromTerraform, as Get does) with the schema's types
// and the model's fields worked out once.

// modelField is a model field that holds one top-level attribute.
type modelField struct {
	index []int // reflect.Value.FieldByIndex, through embedded structs
	typ   attr.Type
}

// stateDecoder decodes a resource's state into one model type.
type stateDecoder struct {
	fields map[string]modelField
}

// newStateDecoder matches a model (a struct whose fields are attr.Values
// tagged `tfsdk:"name"`, or embedded untagged structs of them) against a
// resource's schema: every attribute and block needs exactly one field.
func newStateDecoder(ctx context.Context, r resource.Resource, model any) (*stateDecoder, error) {
	var resp resource.SchemaResponse
	r.Schema(ctx, resource.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() {
		return nil, fmt.Errorf("schema: %v", resp.Diagnostics)
	}
	obj, ok := resp.Schema.Type().(basetypes.ObjectType)
	if !ok {
		return nil, fmt.Errorf("schema type is a %T, not an object", resp.Schema.Type())
	}
	d := &stateDecoder{fields: map[string]modelField{}}
	if err := d.addFields(reflect.TypeOf(model), nil, obj.AttrTypes); err != nil {
		return nil, err
	}
	for name := range obj.AttrTypes {
		if _, ok := d.fields[name]; !ok {
			return nil, fmt.Errorf("%T has no field for attribute %s", model, name)
		}
	}
	return d, nil
}

func (d *stateDecoder) addFields(t reflect.Type, index []int, types map[string]attr.Type) error {
	for i := range t.NumField() {
		f := t.Field(i)
		idx := append(append([]int(nil), index...), i)
		tag := f.Tag.Get("tfsdk")
		if tag == "" && f.Anonymous && f.Type.Kind() == reflect.Struct {
			if err := d.addFields(f.Type, idx, types); err != nil {
				return err
			}
			continue
		}
		typ, ok := types[tag]
		switch {
		case !ok:
			return fmt.Errorf("field %s (tag %q) is no attribute of the schema", f.Name, tag)
		case !f.Type.Implements(attrValueType):
			return fmt.Errorf("field %s is a %s, not an attr.Value", f.Name, f.Type)
		case reflect.TypeOf(typ.ValueType(context.Background())) != f.Type:
			return fmt.Errorf("field %s is a %s, but attribute %s holds a %T", f.Name, f.Type, tag, typ.ValueType(context.Background()))
		}
		if _, dup := d.fields[tag]; dup {
			return fmt.Errorf("two fields for attribute %s", tag)
		}
		d.fields[tag] = modelField{index: idx, typ: typ}
	}
	return nil
}

// decode fills target (a pointer to the model) from a known state object.
func (d *stateDecoder) decode(ctx context.Context, raw tftypes.Value, target any) error {
	var vals map[string]tftypes.Value
	if err := raw.As(&vals); err != nil {
		return err
	}
	if len(vals) != len(d.fields) {
		return fmt.Errorf("the state has %d attributes, the schema %d", len(vals), len(d.fields))
	}
	model := reflect.ValueOf(target).Elem()
	for name, v := range vals {
		f, ok := d.fields[name]
		if !ok {
			return fmt.Errorf("the state has attribute %s, which the schema does not", name)
		}
		av, err := f.typ.ValueFromTerraform(ctx, v)
		if err != nil {
			return fmt.Errorf("attribute %s: %w", name, err)
		}
		model.FieldByIndex(f.index).Set(reflect.ValueOf(av))
	}
	return nil
}

// vmStateDecoder decodes kvm_vm's state into a vmModel; built at the first
// Read of a process.
var vmStateDecoder = sync.OnceValues(func() (*stateDecoder, error) {
	return newStateDecoder(context.Background(), NewVMResource(), vmModel{})
})
