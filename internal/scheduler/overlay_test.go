package scheduler_test

import (
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
)

// An overlay network needs a host with an underlay address; its hosts
// list, when set, applies as for any network.
func TestRejectOverlayNeedsUnderlay(t *testing.T) {
	host := func(name string, underlay bool) scheduler.Host {
		return scheduler.Host{Name: name, Alive: true, Schedulable: true, Images: []string{"sim"}, Underlay: underlay,
			Total: scheduler.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 8192}}
	}
	req := func(n scheduler.NetworkHosts) scheduler.Request {
		return scheduler.Request{Image: "sim", Resources: scheduler.Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 512},
			NetworkHosts: []scheduler.NetworkHosts{n}}
	}
	for _, tc := range []struct {
		name   string
		host   scheduler.Host
		net    scheduler.NetworkHosts
		reason string
		detail string
	}{
		{"overlay, underlay", host("a", true), scheduler.NetworkHosts{Network: "ov", Overlay: true}, "", ""},
		{"overlay, no underlay", host("a", false), scheduler.NetworkHosts{Network: "ov", Overlay: true}, scheduler.ReasonNetwork, "register its underlay_address"},
		{"overlay limited elsewhere", host("a", true), scheduler.NetworkHosts{Network: "ov", Overlay: true, Hosts: []string{"b"}}, scheduler.ReasonNetwork, "not on this host"},
		{"overlay limited here", host("a", true), scheduler.NetworkHosts{Network: "ov", Overlay: true, Hosts: []string{"a"}}, "", ""},
		{"nat, no underlay", host("a", false), scheduler.NetworkHosts{Network: "lan", Hosts: []string{"a"}}, "", ""},
	} {
		r := scheduler.Reject(tc.host, req(tc.net))
		if r.Reason != tc.reason || !strings.Contains(r.Detail, tc.detail) {
			t.Errorf("%s: rejected with %q (%s); want %q containing %q", tc.name, r.Reason, r.Detail, tc.reason, tc.detail)
		}
	}
}
