package provider

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// The decoder Read uses must read a state exactly as tfsdk.State.Get does,
// nested blocks and custom types (timeouts) included.
func TestVMStateDecoderMatchesFrameworkGet(t *testing.T) {
	ctx := context.Background()
	dec, err := vmStateDecoder()
	if err != nil {
		t.Fatalf("the decoder does not match kvm_vm's schema: %v", err)
	}
	var sr resource.SchemaResponse
	NewVMResource().Schema(ctx, resource.SchemaRequest{}, &sr)

	vm := api.VM{ID: "vm-1", Name: "a", Image: "sim", VCPUs: 2, MemoryMiB: 64, DiskMiB: 64, Host: "h1",
		ObservedState: api.StateRunning, Labels: map[string]string{"k": "v"}, UserDataSHA256: "ab", Hostname: "a",
		SSHAuthorizedKeys: []string{"ssh-ed25519 AAAA"}, MetaData: map[string]string{"local-hostname": "x"},
		CreatedAt: time.Unix(1700000000, 0), Placement: &api.Placement{Score: 1.25},
		Constraints: &api.Constraints{HostLabels: map[string]string{"rack": "a"}},
		NetworkInterfaces: []api.NetworkInterface{{Network: "n1", MACAddress: "52:54:00:00:00:01", IPv4Address: "10.0.0.2",
			PortForwards: []api.PortForward{{GuestPort: 22, HostPort: 2222}}}},
		Volumes: []api.VMVolume{{VolumeID: "7f6c2a9e-0d1b-4c3a-9e8f-112233445566", ReadOnly: true}}}
	var want vmModel
	want.Constraints = types.ObjectNull(constraintsAttrTypes)
	want.fromAPI(vm, observedPowerState(vm))
	want.setNICs(vm, true)
	want.UserData = types.StringValue("#cloud-config")
	want.UserDataWO = types.StringNull()
	want.UserDataWOVersion = types.Int64Value(3)
	want.WaitFor = types.StringValue(waitForRunning)
	timeoutTypes := sr.Schema.Type().(basetypes.ObjectType).AttrTypes["timeouts"].(timeouts.Type).AttrTypes
	want.Timeouts.Object = types.ObjectValueMust(timeoutTypes, map[string]attr.Value{
		"create": types.StringValue("1m"), "update": types.StringNull(), "delete": types.StringNull()})

	state := tfsdk.State{Schema: sr.Schema, Raw: tftypes.NewValue(sr.Schema.Type().TerraformType(ctx), nil)}
	if diags := state.Set(ctx, &want); diags.HasError() {
		t.Fatalf("setting the state: %v", diags)
	}
	var viaGet, viaDecoder vmModel
	if diags := state.Get(ctx, &viaGet); diags.HasError() {
		t.Fatalf("framework Get: %v", diags)
	}
	if err := dec.decode(ctx, state.Raw, &viaDecoder); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if !sameAttributes(viaGet, viaDecoder) {
		t.Fatalf("the decoder reads\n%+v\nthe framework\n%+v", viaDecoder, viaGet)
	}
	if create, _ := viaDecoder.Timeouts.Create(ctx, time.Hour); create != time.Minute {
		t.Fatalf("decoded timeouts.create %v, want 1m", create)
	}
	if !viaDecoder.PlacementScore.Equal(viaGet.PlacementScore) || len(viaDecoder.NetworkInterfaces.Elements()) != 1 {
		t.Fatalf("decoded score %v and NICs %v", viaDecoder.PlacementScore, viaDecoder.NetworkInterfaces)
	}

	// A state of another shape is refused, not half read.
	other := tftypes.NewValue(tftypes.Object{AttributeTypes: map[string]tftypes.Type{"id": tftypes.String}},
		map[string]tftypes.Value{"id": tftypes.NewValue(tftypes.String, "x")})
	if err := dec.decode(ctx, other, &viaDecoder); err == nil {
		t.Fatal("a state without kvm_vm's attributes decoded")
	}
}
