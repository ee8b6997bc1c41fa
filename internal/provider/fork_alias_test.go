package provider

import (
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// TestForkChildrenGuestAddressAlias: children[*].guest_ipv4_address is the
// fork answer's alias of the first NIC (a nat network), null without one.
func TestForkChildrenGuestAddressAlias(t *testing.T) {
	list := forkChildren([]api.VM{
		{ID: "c0", Name: "f-0", IPv4Address: "10.72.0.3", NetworkInterfaces: []api.NetworkInterface{
			{Network: "lab", IPv4Address: "10.72.0.3", GuestIPv4Address: "10.72.0.2"}}},
		{ID: "c1", Name: "f-1", IPv4Address: "10.0.2.15", NetworkInterfaces: []api.NetworkInterface{
			{Network: api.DefaultNetwork, IPv4Address: "10.0.2.15"}}},
	})
	elems := list.Elements()
	if len(elems) != 2 {
		t.Fatalf("%d children, want 2", len(elems))
	}
	want := []types.String{types.StringValue("10.72.0.2"), types.StringNull()}
	for i, e := range elems {
		got := e.(types.Object).Attributes()["guest_ipv4_address"]
		if !got.Equal(want[i]) {
			t.Errorf("child %d: guest_ipv4_address %v, want %v", i, got, want[i])
		}
	}
}
