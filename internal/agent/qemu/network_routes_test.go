package qemu_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// A nat network whose range overlaps a route of the host that the agent
// did not make would put the gateway address over the host's LAN (or a
// range reached through it): the agent refuses the VM with a 400 naming
// the route and its device, and makes no bridge. Inside the test's own
// network namespace, the "LAN" is a bridge opnet0 with 10.88.0.1/24 and a
// route to 10.90.0.0/16 through 10.88.0.2; a reserved range is refused by
// the agent as by the control plane.
func TestNATNetworkOverAHostRouteIsRefused(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	lan := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "opnet0"}}
	if err := netlink.LinkAdd(lan); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.88.0.1/24")
	if err := netlink.AddrAdd(lan, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lan); err != nil {
		t.Fatal(err)
	}
	_, beyond, _ := net.ParseCIDR("10.90.0.0/16")
	if err := netlink.RouteAdd(&netlink.Route{Dst: beyond, Gw: net.ParseIP("10.88.0.2"), LinkIndex: lan.Attrs().Index}); err != nil {
		t.Fatal(err)
	}
	a := startNetAgent(t, t.TempDir())
	for i, tc := range []struct{ cidr, gateway, addr, want string }{
		{"10.88.0.0/24", "10.88.0.254", "10.88.0.10", "cidr 10.88.0.0/24 overlaps the route 10.88.0.0/24 dev opnet0"},
		{"10.88.0.128/25", "10.88.0.129", "10.88.0.130", "overlaps the route 10.88.0.0/24 dev opnet0"},
		{"10.90.5.0/24", "10.90.5.1", "10.90.5.10", "overlaps the route 10.90.0.0/16 dev opnet0"},
		{"10.0.0.0/8", "10.0.0.1", "10.0.0.10", "overlaps the route"},
		{"127.0.5.0/24", "127.0.5.1", "127.0.5.10", "overlaps 127.0.0.0/8"},
		{"169.254.169.0/24", "169.254.169.1", "169.254.169.254", "overlaps 169.254.0.0/16"},
	} {
		spec := guest
		spec.NICs = []agentapi.NIC{{Network: "lan", Mode: agentapi.NetworkNAT, MACAddress: "52:54:00:61:00:01",
			CIDR: tc.cidr, Gateway: tc.gateway, DHCP: true, IPv4Address: tc.addr}}
		vm, err := a.client.CreateVM(context.Background(), "x", spec)
		if err == nil {
			_ = syscall.Kill(vm.PID, syscall.SIGKILL)
			_ = a.client.DeleteVM(context.Background(), "x")
			t.Errorf("case %d: a nat network over %s was made beside the host's routes", i, tc.cidr)
			continue
		}
		var e *agentapi.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || !strings.Contains(e.Message, tc.want) {
			t.Errorf("case %d: create on %s: %v; want 400 saying %q", i, tc.cidr, err, tc.want)
		}
	}
	if links := agentLinks(t); len(links) != 0 {
		t.Errorf("refused creates left links %v", links)
	}
	if vms, _ := a.client.ListVMs(context.Background()); len(vms) != 0 {
		t.Errorf("refused creates left vms %+v", vms)
	}
}
