package network_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

func natNIC(netName, cidr, gw, mac, addr string, allow ...string) agentapi.NIC {
	return agentapi.NIC{Network: netName, Mode: agentapi.NetworkNAT, MACAddress: mac, CIDR: cidr, Gateway: gw,
		DHCP: true, IPv4Address: addr, Allow: allow}
}

// fence lists the fence as "family chain tag" lines, sorted.
func fence(t *testing.T) []string {
	t.Helper()
	rules, err := network.ListFence(-1)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, 0, len(rules))
	for _, r := range rules {
		out = append(out, fmt.Sprintf("%s %s %s", r.Family, r.Chain, r.Tag))
	}
	slices.Sort(out)
	return out
}

func count(lines []string, want string) int {
	n := 0
	for _, l := range lines {
		if l == want {
			n++
		}
	}
	return n
}

// The fence is made as NICs come, once (a second attach and a new agent
// re-adopting rewrite it as it was), and goes with the last NIC of each
// network and with each port.
func TestFenceFollowsNetworksAndSurvivesReadoption(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	type nic struct {
		key string
		n   agentapi.NIC
	}
	nics := []nic{
		{"vm-a", natNIC("lan", "10.77.0.0/24", "10.77.0.1", "52:54:00:70:00:0a", "10.77.0.10", "other", "203.0.113.0/24")},
		{"vm-b", natNIC("lan", "10.77.0.0/24", "10.77.0.1", "52:54:00:70:00:0b", "10.77.0.11", "other", "203.0.113.0/24")},
		{"vm-c", natNIC("other", "10.78.0.0/24", "10.78.0.1", "52:54:00:70:00:0c", "10.78.0.10")},
	}
	attach := func(h *network.Host) {
		t.Helper()
		for _, x := range nics {
			if _, err := h.Attach(network.Attachment{VMID: x.key, Key: x.key, NIC: x.n, Guest: x.n}); err != nil {
				t.Fatalf("attach %s: %v", x.key, err)
			}
		}
	}
	h := network.New(nil)
	defer h.Close()
	attach(h)
	first := fence(t)
	lanFwd, otherFwd := "inet fwd-"+network.BridgeName("lan"), "inet fwd-"+network.BridgeName("other")
	for _, want := range []string{
		"inet forward established", "inet input established",
		"inet forward network lan", "inet forward network other",
		"inet input network lan", "inet input network other",
		lanFwd + " own network", lanFwd + " allow network other", lanFwd + " allow 203.0.113.0/24",
		lanFwd + " deny other networks", lanFwd + " deny 10.0.0.0/8", lanFwd + " deny 169.254.0.0/16",
		otherFwd + " own network", otherFwd + " deny other networks",
		"inet in-" + network.BridgeName("lan") + " dhcp", "inet in-" + network.BridgeName("lan") + " deny host",
	} {
		if count(first, want) != 1 {
			t.Errorf("fence has %d of %q; want one. Fence:\n%s", count(first, want), want, strings.Join(first, "\n"))
		}
	}
	if count(first, otherFwd+" allow network lan") != 0 {
		t.Errorf("network other allows nothing, yet its chain allows lan")
	}
	for _, x := range nics {
		tap := network.TapName(x.key, 0)
		for _, want := range []string{"bridge prerouting port " + tap, "bridge port-" + tap + " spoofed mac",
			"bridge port-" + tap + " spoofed address", "bridge port-" + tap + " dhcp server", "bridge port-" + tap + " spoofed arp address"} {
			if count(first, want) != 1 {
				t.Errorf("fence has %d of %q; want one. Fence:\n%s", count(first, want), want, strings.Join(first, "\n"))
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	// Again, and from a new agent: the same rules, none twice.
	attach(h)
	h.Close()
	h = network.New(nil)
	attach(h)
	if again := fence(t); !slices.Equal(again, first) {
		t.Fatalf("fence after re-attach and re-adoption:\n%s\nwant as before:\n%s", strings.Join(again, "\n"), strings.Join(first, "\n"))
	}

	// The last NIC of a network takes the network's fence; each NIC its port's.
	if err := h.Detach("vm-a", 0, nics[0].n); err != nil {
		t.Fatal(err)
	}
	f := fence(t)
	if count(f, "inet forward network lan") != 1 || slices.ContainsFunc(f, func(l string) bool { return strings.Contains(l, network.TapName("vm-a", 0)) }) {
		t.Fatalf("after detaching a: fence\n%s\nwant lan's kept and a's port gone", strings.Join(f, "\n"))
	}
	if err := h.Detach("vm-b", 0, nics[1].n); err != nil {
		t.Fatal(err)
	}
	f = fence(t)
	if slices.ContainsFunc(f, func(l string) bool {
		return strings.Contains(l, "lan") || strings.Contains(l, network.BridgeName("lan"))
	}) ||
		count(f, "inet forward network other") != 1 {
		t.Fatalf("after detaching lan's last nic: fence\n%s\nwant nothing of lan, other's kept", strings.Join(f, "\n"))
	}
	if err := h.Detach("vm-c", 0, nics[2].n); err != nil {
		t.Fatal(err)
	}
	if f := fence(t); len(f) != 0 {
		t.Fatalf("after detaching every nic: fence\n%s\nwant none", strings.Join(f, "\n"))
	}
	if rules, err := network.ListRules(-1); err != nil || len(rules) != 0 {
		t.Fatalf("nat rules after detaching every nic: %+v, %v", rules, err)
	}
}

// On an operator's bridge without a cidr the agent knows the MAC only: the
// port checks the MAC and drops DHCP server traffic, and lets IPv6 pass
// (an operator's LAN may carry it) but for router advertisements.
func TestFenceOfABridgeNICWithoutAddress(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "opbr0"}}); err != nil {
		t.Fatal(err)
	}
	h := network.New(nil)
	defer h.Close()
	n := agentapi.NIC{Network: "ops", Mode: agentapi.NetworkBridge, Bridge: "opbr0", MACAddress: "52:54:00:71:00:01"}
	if _, err := h.Attach(network.Attachment{VMID: "vm-o", Key: "vm-o", NIC: n, Guest: n}); err != nil {
		t.Fatal(err)
	}
	port := "bridge port-" + network.TapName("vm-o", 0)
	f := fence(t)
	for _, want := range []string{port + " spoofed mac", port + " spoofed arp mac", port + " dhcp server",
		port + " router advertisement", port + " ipv6", port + " other"} {
		if count(f, want) != 1 {
			t.Errorf("fence has %d of %q; want one", count(f, want), want)
		}
	}
	for _, l := range f {
		if strings.HasPrefix(l, "inet ") || strings.Contains(l, "address") {
			t.Errorf("fence has %q: a bridge network has no forward or input chain, and no address is known", l)
		}
	}
	if err := h.Detach("vm-o", 0, n); err != nil {
		t.Fatal(err)
	}
	if f := fence(t); len(f) != 0 {
		t.Fatalf("after detach: fence\n%s\nwant none", strings.Join(f, "\n"))
	}
	if _, err := netlink.LinkByName("opbr0"); err != nil {
		t.Fatalf("the operator's bridge is gone: %v", err)
	}
}
