package agent_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

func userNIC(mac string, guestPorts ...int) agentapi.NIC {
	n := agentapi.NIC{Network: "default", Mode: agentapi.NetworkUser, MACAddress: mac}
	for _, p := range guestPorts {
		n.PortForwards = append(n.PortForwards, agentapi.PortForward{GuestPort: p})
	}
	return n
}

func natNIC(mac, addr string) agentapi.NIC {
	return agentapi.NIC{Network: "lan", Mode: agentapi.NetworkNAT, MACAddress: mac, CIDR: "10.77.0.0/24",
		Gateway: "10.77.0.1", DHCP: true, IPv4Address: addr}
}

// hostPorts returns the host ports of every forward of vm, checking that
// each is on 127.0.0.1.
func hostPorts(t *testing.T, vm agentapi.VM) []int {
	t.Helper()
	var out []int
	for _, n := range vm.NICs {
		for _, f := range n.PortForwards {
			if f.HostAddress != "127.0.0.1" || f.HostPort == 0 {
				t.Fatalf("vm %s: forward %+v has no host address and port", vm.ID, f)
			}
			out = append(out, f.HostPort)
		}
	}
	return out
}

func TestSimNICsAreRecordedWithUniqueHostPortsAcrossRestarts(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	a := spec
	a.NICs = []agentapi.NIC{userNIC("52:54:00:00:00:01", 80, 22), natNIC("52:54:00:00:00:02", "10.77.0.10")}
	vmA, err := h.client.CreateVM(ctx, "a", a)
	if err != nil {
		t.Fatal(err)
	}
	if len(vmA.NICs) != 2 || vmA.NICs[1].IPv4Address != "10.77.0.10" || vmA.NICs[0].MACAddress != "52:54:00:00:00:01" {
		t.Fatalf("nics of a = %+v; want the spec's echoed", vmA.NICs)
	}
	seen := map[int]string{}
	for _, p := range hostPorts(t, vmA) {
		seen[p] = "a"
	}
	if len(seen) != 2 {
		t.Fatalf("forwards of a share a host port: %+v", vmA.NICs)
	}
	// The same PUT again is the same VM, with the same ports; other NICs conflict.
	if again, err := h.client.CreateVM(ctx, "a", a); err != nil || hostPorts(t, again)[0] != hostPorts(t, vmA)[0] {
		t.Fatalf("second PUT = %+v, %v; want the same vm and ports", again, err)
	}
	other := a
	other.NICs = []agentapi.NIC{userNIC("52:54:00:00:00:09")}
	if _, err := h.client.CreateVM(ctx, "a", other); statusOf(err) != http.StatusConflict {
		t.Fatalf("PUT with other nics: %v; want 409", err)
	}
	con, err := h.client.Console(ctx, "a")
	if err != nil || !strings.Contains(con, "simulated: no socket listens") {
		t.Fatalf("console = %q, %v; want it to say the forwards are simulated", con, err)
	}

	// A new agent on the same state keeps a's ports and never hands them out again.
	h.stop()
	h = startHarness(t, dir, 0)
	got, err := h.client.GetVM(ctx, "a")
	if err != nil || len(got.NICs) != 2 || hostPorts(t, got)[0] != hostPorts(t, vmA)[0] {
		t.Fatalf("after restart a = %+v, %v; want its nics and ports", got, err)
	}
	for i := range 20 {
		b := spec
		b.NICs = []agentapi.NIC{userNIC("52:54:00:00:01:01", 80)}
		id := "b" + string(rune('a'+i))
		vm, err := h.client.CreateVM(ctx, id, b)
		if err != nil {
			t.Fatal(err)
		}
		p := hostPorts(t, vm)[0]
		if owner, dup := seen[p]; dup {
			t.Fatalf("vm %s got host port %d of vm %s", id, p, owner)
		}
		seen[p] = id
	}
	vms, err := h.client.ListVMs(ctx)
	if err != nil || len(vms) != 21 {
		t.Fatalf("list = %d vms, %v", len(vms), err)
	}
	for _, vm := range vms {
		if len(vm.NICs) == 0 {
			t.Fatalf("list answer of %s has no nics", vm.ID)
		}
	}
}

func TestBadNICsAreRejectedAndStartNothing(t *testing.T) {
	h := startHarness(t, t.TempDir(), 0)
	ctx := context.Background()
	mod := func(f func(*agentapi.NIC)) []agentapi.NIC {
		n := natNIC("52:54:00:00:00:02", "10.77.0.10")
		f(&n)
		return []agentapi.NIC{n}
	}
	cases := []struct {
		name string
		nics []agentapi.NIC
		want string
	}{
		{"bad mac", mod(func(n *agentapi.NIC) { n.MACAddress = "52:54:00:zz:00:02" }), "not a 6-byte MAC"},
		{"no mac", mod(func(n *agentapi.NIC) { n.MACAddress = "" }), "not a 6-byte MAC"},
		{"multicast mac", mod(func(n *agentapi.NIC) { n.MACAddress = "01:00:5e:00:00:01" }), "multicast"},
		{"bad mode", mod(func(n *agentapi.NIC) { n.Mode = "macvtap" }), `mode "macvtap" is not one of`},
		{"bad cidr", mod(func(n *agentapi.NIC) { n.CIDR = "10.77.0.0/33" }), "not an IPv4 network"},
		{"cidr with host bits", mod(func(n *agentapi.NIC) { n.CIDR = "10.77.0.5/24" }), "not an IPv4 network"},
		{"gateway outside", mod(func(n *agentapi.NIC) { n.Gateway = "10.78.0.1" }), "gateway 10.78.0.1 is not a host address of 10.77.0.0/24"},
		{"address outside", mod(func(n *agentapi.NIC) { n.IPv4Address = "10.77.1.3" }), "ipv4_address 10.77.1.3 is not a host address"},
		{"address is gateway", mod(func(n *agentapi.NIC) { n.IPv4Address = "10.77.0.1" }), "is the gateway's address"},
		{"broadcast", mod(func(n *agentapi.NIC) { n.IPv4Address = "10.77.0.255" }), "not a host address"},
		{"nat without cidr", mod(func(n *agentapi.NIC) { n.CIDR = "" }), "mode nat needs cidr"},
		{"forward on nat", mod(func(n *agentapi.NIC) { n.PortForwards = []agentapi.PortForward{{GuestPort: 80}} }), "port_forwards are for mode user only"},
		{"bad bridge name", mod(func(n *agentapi.NIC) { n.Mode, n.Bridge = agentapi.NetworkBridge, "a/b" }), `bridge "a/b" is not a valid interface name`},
		{"long bridge name", mod(func(n *agentapi.NIC) { n.Mode, n.Bridge = agentapi.NetworkBridge, "abcdefghijklmnop" }), "not a valid interface name"},
		{"missing bridge", mod(func(n *agentapi.NIC) { n.Mode, n.Bridge = agentapi.NetworkBridge, "nobr7" }), "bridge nobr7 does not exist on host"},
		{"bad network", mod(func(n *agentapi.NIC) { n.Network = "" }), "not a valid network name"},
		{"guest port", []agentapi.NIC{userNIC("52:54:00:00:00:01", 0)}, "guest_port 0 is not between"},
		{"port twice", []agentapi.NIC{userNIC("52:54:00:00:00:01", 80, 80)}, "forwarded twice"},
		{"same mac twice", []agentapi.NIC{userNIC("52:54:00:00:00:01"), userNIC("52:54:00:00:00:01")}, "also the MAC of nics[0]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := spec
			s.NICs = tc.nics
			_, err := h.client.CreateVM(ctx, "bad", s)
			var e *agentapi.Error
			if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != "invalid" || !strings.Contains(e.Message, tc.want) {
				t.Fatalf("create = %v; want 400 invalid containing %q", err, tc.want)
			}
		})
	}
	// A bridge the (simulated) host has is fine.
	s := spec
	s.NICs = mod(func(n *agentapi.NIC) { n.Mode, n.Bridge = agentapi.NetworkBridge, "br0" })
	if _, err := h.client.CreateVM(ctx, "good", s); err != nil {
		t.Fatalf("nic on bridge br0: %v", err)
	}
	entries, _ := os.ReadDir(filepath.Join(h.dir, "vms"))
	if len(entries) != 1 || h.driver.boots.Load() != 1 {
		t.Fatalf("bad nics left %d dirs and %d boots; want only vm good", len(entries), h.driver.boots.Load())
	}
}

func TestSimChildrenOfANetworkedVMKeepTheGuestViewAndGetTheirOwnNICs(t *testing.T) {
	s := startSnapAgent(t, t.TempDir())
	ctx := context.Background()
	src := spec
	src.NICs = []agentapi.NIC{natNIC("52:54:00:00:00:02", "10.77.0.10"), userNIC("52:54:00:00:00:03", 80)}
	if _, err := s.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	snap, err := s.client.CreateSnapshot(ctx, "snap", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.NICs) != 2 || snap.NICs[0].IPv4Address != "10.77.0.10" || len(snap.NICs[1].PortForwards) != 1 ||
		snap.NICs[1].PortForwards[0].HostPort != 0 {
		t.Fatalf("snapshot nics = %+v; want the source's guest view without host ports", snap.NICs)
	}
	child := spec
	child.Snapshot = &agentapi.SnapshotSource{ID: "snap"}
	child.NICs = []agentapi.NIC{natNIC("52:54:00:00:10:02", "10.77.0.11"), userNIC("52:54:00:00:10:03", 80)}
	vm, err := s.client.CreateVM(ctx, "child", child)
	if err != nil {
		t.Fatal(err)
	}
	if vm.NICs[0].IPv4Address != "10.77.0.11" || vm.NICs[0].MACAddress != "52:54:00:00:10:02" || len(hostPorts(t, vm)) != 1 {
		t.Fatalf("child nics = %+v; want its own address, MAC and host port", vm.NICs)
	}
	srcVM, _ := s.client.GetVM(ctx, "src")
	if hostPorts(t, srcVM)[0] == hostPorts(t, vm)[0] {
		t.Fatalf("child and source share host port %d", hostPorts(t, vm)[0])
	}
	bad := child
	bad.NICs = child.NICs[:1]
	if _, err := s.client.CreateVM(ctx, "bad", bad); statusOf(err) != http.StatusBadRequest || !strings.Contains(err.Error(), "needs 2 nics") {
		t.Fatalf("child with 1 nic of a 2-nic source: %v; want 400", err)
	}
	if _, err := s.client.GetVM(ctx, "bad"); statusOf(err) != http.StatusNotFound {
		t.Fatalf("the bad child exists: %v", err)
	}
}

// Warm VMs are booted without a NIC: a create with NICs boots cold (its
// NICs on QEMU's command line from the start) and leaves the pool be.
func TestWarmPoolServesOnlyCreatesWithoutNICs(t *testing.T) {
	d := newPoolDriver()
	h := startPoolAgent(t, t.TempDir(), d, agent.PoolOptions{})
	ctx := context.Background()
	if _, err := h.client.SetPool(ctx, "sim", poolShape(1)); err != nil {
		t.Fatal(err)
	}
	waitReady(t, h, 1)
	withNIC := poolSpec
	withNIC.NICs = []agentapi.NIC{userNIC("52:54:00:00:02:01", 80)}
	vm, err := h.client.CreateVM(ctx, "net", withNIC)
	if err != nil || vm.StartedFrom != agentapi.StartedCold || len(hostPorts(t, vm)) != 1 {
		t.Fatalf("create with a nic = %+v, %v; want a cold start with its forward", vm, err)
	}
	if r := poolRow(t, h.client, "sim"); r.Ready != 1 {
		t.Fatalf("a create with nics took from the pool: %+v", r)
	}
	if vm, err := h.client.CreateVM(ctx, "plain", poolSpec); err != nil || vm.StartedFrom != agentapi.StartedWarm {
		t.Fatalf("create without nics = %+v, %v; want warm", vm, err)
	}
}
