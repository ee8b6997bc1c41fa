package main

import (
	"fmt"

	"github.com/hashicorp/terraform-plugin-go/tftypes"
)

// withKnownValues is what a do-nothing provider "creates": the planned value
// with every unknown (a computed attribute the configuration leaves out)
// replaced by a fixed value of its type. Both modes apply through it.
func withKnownValues(planned tftypes.Value) (tftypes.Value, error) {
	return tftypes.Transform(planned, func(_ *tftypes.AttributePath, v tftypes.Value) (tftypes.Value, error) {
		if v.IsKnown() {
			return v, nil
		}
		return fixedValue(v.Type())
	})
}

func fixedValue(t tftypes.Type) (tftypes.Value, error) {
	switch t.(type) {
	case tftypes.Map:
		return tftypes.NewValue(t, map[string]tftypes.Value{}), nil
	case tftypes.List, tftypes.Set:
		return tftypes.NewValue(t, []tftypes.Value{}), nil
	}
	switch {
	case t.Is(tftypes.String):
		return tftypes.NewValue(t, "floor"), nil
	case t.Is(tftypes.Number):
		return tftypes.NewValue(t, 0), nil
	case t.Is(tftypes.Bool):
		return tftypes.NewValue(t, false), nil
	}
	return tftypes.Value{}, fmt.Errorf("no fixed value for an unknown %s", t)
}
