package control_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A network over a reserved range would hand guests the host's loopback,
// the link-local metadata address (169.254.169.254) or addresses no host
// routes: each is a 400 invalid naming the range, through the control
// API, for nat and bridge networks; a gateway on the network or broadcast
// address stays refused too.
func TestNetworkOverReservedRangeRefused(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ctx := ctxT(t)
	bridged := func(cidr string) api.NetworkCreate {
		return api.NetworkCreate{Name: "x", Mode: api.NetworkBridge, Bridge: "br0", CIDR: cidr}
	}
	for _, tc := range []struct {
		in   api.NetworkCreate
		want string
	}{
		{natNet("x", "0.0.0.0/24"), "overlaps 0.0.0.0/8"},
		{natNet("x", "0.255.0.0/16"), "overlaps 0.0.0.0/8"},
		{natNet("x", "127.0.0.0/24"), "overlaps 127.0.0.0/8, the host's loopback"},
		{natNet("x", "127.1.0.0/16"), "overlaps 127.0.0.0/8"},
		{natNet("x", "169.254.169.0/24"), "overlaps 169.254.0.0/16, link-local"},
		{api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "169.254.0.0/16", Gateway: "169.254.169.254"}, "overlaps 169.254.0.0/16"},
		{natNet("x", "224.0.0.0/24"), "overlaps 224.0.0.0/4, multicast"},
		{natNet("x", "239.255.0.0/16"), "overlaps 224.0.0.0/4"},
		{natNet("x", "240.0.0.0/24"), "overlaps 240.0.0.0/4"},
		{natNet("x", "255.255.255.252/30"), "overlaps 240.0.0.0/4, reserved (RFC 1112), with the broadcast address 255.255.255.255"},
		{bridged("127.0.0.0/24"), "overlaps 127.0.0.0/8"},
		{bridged("169.254.1.0/24"), "overlaps 169.254.0.0/16"},
		{api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Gateway: "10.30.0.0"}, "gateway 10.30.0.0 is outside the usable addresses"},
		{api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Gateway: "10.30.0.255"}, "gateway 10.30.0.255 is outside the usable addresses"},
	} {
		_, err := c.Client.CreateNetwork(ctx, tc.in)
		var e *client.Error
		if !errors.As(err, &e) || e.Status != 400 || e.Code != api.CodeInvalid || !strings.Contains(e.Message, tc.want) {
			t.Errorf("%s %s (gateway %q): got %v; want 400 invalid saying %q", tc.in.Mode, tc.in.CIDR, tc.in.Gateway, err, tc.want)
		}
	}
	if got := networkNames(t, c.Client); !slices.Equal(got, []string{"default"}) {
		t.Errorf("networks after refused creates: %v, want [default]", got)
	}
	// Private ranges stay networks.
	if _, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.30.0.0/24")); err != nil {
		t.Fatal(err)
	}
}
