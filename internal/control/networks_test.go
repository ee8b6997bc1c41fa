package control_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var macPattern = regexp.MustCompile(`^02(:[0-9a-f]{2}){5}$`)

func natNet(name, cidr string) api.NetworkCreate {
	return api.NetworkCreate{Name: name, Mode: api.NetworkNAT, CIDR: cidr}
}

func vmOn(name string, nics ...api.NetworkInterface) api.VMCreate {
	in := smallVM(name)
	in.NetworkInterfaces = nics
	return in
}

func networkNames(t *testing.T, c *client.Client) []string {
	t.Helper()
	nets, err := c.ListNetworks(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, n := range nets {
		out = append(out, n.Name)
	}
	return out
}

// Every refused network is a 4xx whose message names the field, and
// nothing is created.
func TestNetworkCreateRefusesBadInput(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		ctx := ctxT(t)
		if _, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24")); err != nil {
			t.Fatal(err)
		}
		yes := true
		cases := []struct {
			name   string
			in     api.NetworkCreate
			status int
			want   string
		}{
			{"unknown mode", api.NetworkCreate{Name: "x", Mode: "vlan"}, 400, "mode"},
			{"no name", api.NetworkCreate{Mode: api.NetworkUser}, 400, "name"},
			{"nat without cidr", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT}, 400, "cidr is required"},
			{"cidr not ipv4", natNet("x", "fd00::/64"), 400, "cidr"},
			{"cidr garbage", natNet("x", "10.1.0.0"), 400, "cidr"},
			{"prefix too short", natNet("x", "10.0.0.0/8"), 400, "prefix"},
			{"prefix too long", natNet("x", "10.30.0.0/31"), 400, "prefix"},
			{"host bits", natNet("x", "10.30.0.5/24"), 400, "10.30.0.0/24"},
			{"gateway outside", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Gateway: "10.31.0.1"}, 400, "gateway"},
			{"gateway is broadcast", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Gateway: "10.30.0.255"}, 400, "gateway"},
			{"gateway not an address", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Gateway: "gw"}, 400, "gateway"},
			{"nat with bridge", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Bridge: "br0"}, 400, "bridge"},
			{"bridge without name", api.NetworkCreate{Name: "x", Mode: api.NetworkBridge}, 400, "bridge is required"},
			{"bridge name too long", api.NetworkCreate{Name: "x", Mode: api.NetworkBridge, Bridge: "a-very-long-bridge-name"}, 400, "bridge"},
			{"user with cidr", api.NetworkCreate{Name: "x", Mode: api.NetworkUser, CIDR: "10.30.0.0/24"}, 400, "cidr"},
			{"user with dhcp", api.NetworkCreate{Name: "x", Mode: api.NetworkUser, DHCP: &yes}, 400, "dhcp"},
			{"host listed twice", api.NetworkCreate{Name: "x", Mode: api.NetworkUser, Hosts: []string{"h1", "h1"}}, 400, "hosts"},
			{"overlapping cidr", natNet("x", "10.20.0.128/25"), 409, `network "lan"`},
			{"overlapping wider cidr", natNet("x", "10.20.0.0/16"), 409, `network "lan"`},
			{"name taken", natNet("lan", "10.40.0.0/24"), 409, "already exists"},
			{"default taken", api.NetworkCreate{Name: "default", Mode: api.NetworkUser}, 409, "already exists"},
		}
		for _, tc := range cases {
			_, err := c.Client.CreateNetwork(ctx, tc.in)
			var e *client.Error
			if !errors.As(err, &e) || e.Status != tc.status || !strings.Contains(e.Message, tc.want) {
				t.Errorf("%s: got %v; want %d naming %q", tc.name, err, tc.status, tc.want)
			}
		}
		if got := networkNames(t, c.Client); !slices.Equal(got, []string{"default", "lan"}) {
			t.Errorf("networks after refused creates: %v, want [default lan]", got)
		}
	})
}

func TestNetworkLifecycle(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", d.Address)
		ctx := ctxT(t)

		def, err := c.Client.GetNetwork(ctx, "default")
		if err != nil || def.Mode != api.NetworkUser {
			t.Fatalf("default network: %+v, %v; want one of mode user out of the box", def, err)
		}
		n, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24"))
		if err != nil {
			t.Fatal(err)
		}
		if n.Gateway != "10.20.0.1" || !n.DHCP || n.AddressesTotal != 253 || n.AddressesUsed != 0 {
			t.Errorf("created %+v; want gateway 10.20.0.1, dhcp on, 253 addresses, none used", n)
		}
		n, err = c.Client.UpdateNetwork(ctx, "lan", api.NetworkPatch{Hosts: &[]string{"h1"}})
		if err != nil || !slices.Equal(n.Hosts, []string{"h1"}) {
			t.Fatalf("update hosts: %+v, %v", n, err)
		}
		vm, err := c.Client.CreateVM(ctx, vmOn("web", api.NetworkInterface{Network: "lan"}), "")
		if err != nil {
			t.Fatal(err)
		}
		if n, _ = c.Client.GetNetwork(ctx, "lan"); n.AddressesUsed != 1 {
			t.Errorf("addresses_used %d after one VM, want 1", n.AddressesUsed)
		}
		err = c.Client.DeleteNetwork(ctx, "lan")
		if !errors.Is(err, client.ErrConflict) || !strings.Contains(err.Error(), vm.ID) || !strings.Contains(err.Error(), "web") {
			t.Errorf("delete of a network in use: %v; want 409 naming VM web (%s)", err, vm.ID)
		}
		if err := c.Client.DeleteNetwork(ctx, "default"); !errors.Is(err, client.ErrConflict) {
			t.Errorf("delete of the default network: %v, want 409", err)
		}
		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		if n, _ = c.Client.GetNetwork(ctx, "lan"); n.AddressesUsed != 0 {
			t.Errorf("addresses_used %d after the VM's delete, want 0", n.AddressesUsed)
		}
		if err := c.Client.DeleteNetwork(ctx, "lan"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Client.GetNetwork(ctx, "lan"); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("get after delete: %v, want 404", err)
		}
	})
}

// A VM's NICs: MACs derived and unique, IPAM addresses inside the range,
// user mode at QEMU's address with the agent's forwarded ports, the
// top-level ipv4_address the first NIC's, and what the agent was asked.
func TestVMNetworkInterfaces(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", d.Address)
		ctx := ctxT(t)
		if _, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24")); err != nil {
			t.Fatal(err)
		}

		plain, err := c.Client.CreateVM(ctx, smallVM("plain"), "")
		if err != nil {
			t.Fatal(err)
		}
		if len(plain.NetworkInterfaces) != 1 || plain.NetworkInterfaces[0].Network != "default" ||
			plain.IPv4Address != "10.0.2.15" || !macPattern.MatchString(plain.NetworkInterfaces[0].MACAddress) {
			t.Errorf("VM without network_interfaces: %+v (ipv4 %q); want one NIC on default at 10.0.2.15 with a 02: MAC", plain.NetworkInterfaces, plain.IPv4Address)
		}

		vm, err := c.Client.CreateVM(ctx, vmOn("two",
			api.NetworkInterface{Network: "lan"},
			api.NetworkInterface{Network: "default", PortForwards: []api.PortForward{{GuestPort: 80}, {GuestPort: 22}}}), "")
		if err != nil {
			t.Fatal(err)
		}
		lan, user := vm.NetworkInterfaces[0], vm.NetworkInterfaces[1]
		addr, err := netip.ParseAddr(lan.IPv4Address)
		if err != nil || !netip.MustParsePrefix("10.20.0.0/24").Contains(addr) || lan.IPv4Address == "10.20.0.1" || lan.IPv4Address == "10.20.0.0" {
			t.Errorf("nat NIC address %q: want a host address of 10.20.0.0/24 other than the gateway", lan.IPv4Address)
		}
		if vm.IPv4Address != lan.IPv4Address {
			t.Errorf("ipv4_address %q, want the first NIC's %q", vm.IPv4Address, lan.IPv4Address)
		}
		if lan.MACAddress == user.MACAddress || !macPattern.MatchString(lan.MACAddress) || !macPattern.MatchString(user.MACAddress) {
			t.Errorf("MACs %s and %s: want two distinct locally administered unicast MACs", lan.MACAddress, user.MACAddress)
		}
		if len(user.PortForwards) != 2 || user.PortForwards[0].HostAddress != "127.0.0.1" || user.PortForwards[0].HostPort == 0 {
			t.Errorf("forwards %+v: want the host address and port the agent chose", user.PortForwards)
		}
		got, err := c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.EqualFunc(got.NetworkInterfaces, vm.NetworkInterfaces, nicEqual) || got.IPv4Address != vm.IPv4Address {
			t.Errorf("GET shows %+v, create answered %+v", got.NetworkInterfaces, vm.NetworkInterfaces)
		}
		asked := d.NICs(vm.ID)
		if len(asked) != 2 || asked[0].Mode != api.NetworkNAT || asked[0].CIDR != "10.20.0.0/24" || asked[0].Gateway != "10.20.0.1" ||
			!asked[0].DHCP || asked[0].IPv4Address != lan.IPv4Address || asked[0].MACAddress != lan.MACAddress ||
			asked[1].Mode != api.NetworkUser || len(asked[1].PortForwards) != 2 {
			t.Errorf("agent was asked for %+v", asked)
		}

		// Only a VM with exactly one user NIC without forwards may take a
		// warm pool VM (pool VMs boot with that); any other boots cold.
		if d.Spec(plain.ID).NoWarm || !d.Spec(vm.ID).NoWarm {
			t.Errorf("no_warm: %v for one default NIC, %v for a nat and a forwarding NIC; want false and true",
				d.Spec(plain.ID).NoWarm, d.Spec(vm.ID).NoWarm)
		}

		fixed, err := c.Client.CreateVM(ctx, vmOn("fixed", api.NetworkInterface{Network: "lan", IPv4Address: "10.20.0.200"}), "")
		if err != nil || fixed.IPv4Address != "10.20.0.200" {
			t.Fatalf("fixed address: %+v, %v", fixed.NetworkInterfaces, err)
		}
		checkNICLedger(t, c.Store)
	})
}

func nicEqual(a, b api.NetworkInterface) bool {
	return a.Network == b.Network && a.MACAddress == b.MACAddress && a.IPv4Address == b.IPv4Address &&
		slices.Equal(a.PortForwards, b.PortForwards)
}

// Bad NIC requests are clear 4xx and leave nothing behind: no VM row, no
// capacity, no address.
func TestVMNetworkInterfacesRefuseBadInput(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{Bridges: []string{"br-ok"}})
		c.RegisterHost(t, "h1", d.Address)
		ctx := ctxT(t)
		for _, n := range []api.NetworkCreate{natNet("lan", "10.20.0.0/24"),
			{Name: "ext", Mode: api.NetworkBridge, Bridge: "br-missing", CIDR: "192.168.50.0/24"}} {
			if _, err := c.Client.CreateNetwork(ctx, n); err != nil {
				t.Fatal(err)
			}
		}
		holder, err := c.Client.CreateVM(ctx, vmOn("holder", api.NetworkInterface{Network: "lan", IPv4Address: "10.20.0.10"}), "")
		if err != nil {
			t.Fatal(err)
		}
		nic := func(n, addr string, ports ...int) api.NetworkInterface {
			out := api.NetworkInterface{Network: n, IPv4Address: addr}
			for _, p := range ports {
				out.PortForwards = append(out.PortForwards, api.PortForward{GuestPort: p})
			}
			return out
		}
		cases := []struct {
			name   string
			nics   []api.NetworkInterface
			status int
			want   []string
		}{
			{"unknown network", []api.NetworkInterface{nic("nope", "")}, 400, []string{`network "nope" does not exist`}},
			{"address in use", []api.NetworkInterface{nic("lan", "10.20.0.10")}, 409, []string{"held by VM holder", holder.ID}},
			{"address outside", []api.NetworkInterface{nic("lan", "10.21.0.10")}, 400, []string{"outside", "10.20.0.0/24"}},
			{"network address", []api.NetworkInterface{nic("lan", "10.20.0.0")}, 400, []string{"outside"}},
			{"broadcast address", []api.NetworkInterface{nic("lan", "10.20.0.255")}, 400, []string{"outside"}},
			{"gateway address", []api.NetworkInterface{nic("lan", "10.20.0.1")}, 400, []string{"gateway"}},
			{"address on user network", []api.NetworkInterface{nic("default", "10.0.2.15")}, 400, []string{"ipv4_address"}},
			{"forward on nat", []api.NetworkInterface{nic("lan", "", 80)}, 400, []string{"port_forwards"}},
			{"forward port 0", []api.NetworkInterface{nic("default", "", 0)}, 400, []string{"guest_port"}},
			{"forward twice", []api.NetworkInterface{nic("default", "", 80, 80)}, 400, []string{"twice"}},
			{"bridge missing on host", []api.NetworkInterface{nic("ext", "")}, 400, []string{"br-missing", "does not exist on host"}},
		}
		for _, tc := range cases {
			_, err := noRetry(c).CreateVM(ctx, vmOn("bad", tc.nics...), "")
			var e *client.Error
			if !errors.As(err, &e) || e.Status != tc.status {
				t.Errorf("%s: got %v; want %d", tc.name, err, tc.status)
				continue
			}
			for _, w := range tc.want {
				if !strings.Contains(e.Message, w) {
					t.Errorf("%s: message %q does not name %q", tc.name, e.Message, w)
				}
			}
		}
		vms, err := c.Client.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(vms) != 1 {
			t.Errorf("%d VMs after refused creates, want only the holder", len(vms))
		}
		for _, name := range []string{"lan", "ext"} {
			if n, _ := c.Client.GetNetwork(ctx, name); n.AddressesUsed != map[string]int{"lan": 1, "ext": 0}[name] {
				t.Errorf("network %s: %d addresses used after refused creates", name, n.AddressesUsed)
			}
		}
		if a := hostAllocated(t, c, "h1"); a.VCPUs != 1 {
			t.Errorf("host allocation %+v after refused creates, want the holder's alone", a)
		}
		checkNICLedger(t, c.Store)
	})
}

// A network limited to some hosts is a placement filter with a named reason.
func TestNetworkHostsSteerPlacement(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ctx := ctxT(t)
	for _, h := range []string{"h1", "h2"} {
		c.RegisterHost(t, h, testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{}).Address)
	}
	only2 := natNet("lan", "10.20.0.0/24")
	only2.Hosts = []string{"h2"}
	if _, err := c.Client.CreateNetwork(ctx, only2); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		vm, err := c.Client.CreateVM(ctx, vmOn(fmt.Sprintf("vm-%d", i), api.NetworkInterface{Network: "lan"}), "")
		if err != nil {
			t.Fatal(err)
		}
		if vm.Host != "h2" {
			t.Errorf("VM on network lan (hosts [h2]) placed on %s", vm.Host)
		}
	}
	pinned := vmOn("pinned", api.NetworkInterface{Network: "lan"})
	pinned.Host = "h1"
	_, err := noRetry(c).CreateVM(ctx, pinned, "")
	if !errors.Is(err, client.ErrNoCapacity) || !strings.Contains(err.Error(), "network:") {
		t.Errorf("VM pinned to h1 on a network of h2: %v; want no_capacity with a network reason", err)
	}
}

// Fork children get NICs of their own on the source's networks: their own
// MACs and addresses; the source keeps its own.
func TestForkChildrenGetTheirOwnAddresses(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 64, MemoryMiB: 64 * 1024, DiskMiB: 1 << 20})
		c.RegisterHost(t, "h1", a.Address)
		ctx := ctxT(t)
		if _, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24")); err != nil {
			t.Fatal(err)
		}
		src, err := c.Client.CreateVM(ctx, vmOn("src", api.NetworkInterface{Network: "lan"}, api.NetworkInterface{Network: "default"}), "")
		if err != nil {
			t.Fatal(err)
		}
		f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 3}, "")
		if err != nil {
			t.Fatal(err)
		}
		seenAddr := map[string]string{src.IPv4Address: src.Name}
		seenMAC := map[string]string{src.NetworkInterfaces[0].MACAddress: src.Name, src.NetworkInterfaces[1].MACAddress: src.Name}
		for _, child := range f.Children {
			if len(child.NetworkInterfaces) != 2 || child.NetworkInterfaces[0].Network != "lan" || child.NetworkInterfaces[1].Network != "default" {
				t.Fatalf("child %s NICs %+v, want lan and default like the source", child.Name, child.NetworkInterfaces)
			}
			if other, dup := seenAddr[child.IPv4Address]; dup || child.IPv4Address == "" {
				t.Errorf("child %s has address %q, also held by %s", child.Name, child.IPv4Address, other)
			}
			seenAddr[child.IPv4Address] = child.Name
			for _, n := range child.NetworkInterfaces {
				if other, dup := seenMAC[n.MACAddress]; dup {
					t.Errorf("child %s has MAC %s of %s", child.Name, n.MACAddress, other)
				}
				seenMAC[n.MACAddress] = child.Name
			}
		}
		if got, _ := c.Client.GetVM(ctx, src.ID); got.IPv4Address != src.IPv4Address {
			t.Errorf("source address %q after the fork, want %q", got.IPv4Address, src.IPv4Address)
		}
		if n, _ := c.Client.GetNetwork(ctx, "lan"); n.AddressesUsed != 4 {
			t.Errorf("addresses_used %d, want 4 (source and 3 children)", n.AddressesUsed)
		}
		if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
			t.Fatal(err)
		}
		if n, _ := c.Client.GetNetwork(ctx, "lan"); n.AddressesUsed != 1 {
			t.Errorf("addresses_used %d after the fork's delete, want the source's 1", n.AddressesUsed)
		}
		checkNICLedger(t, c.Store)
	})
}

// Concurrent creates on a /24 nat network (253 addresses beside the
// gateway) with room for all of them: exactly 253 get an address, each a
// different one, the rest get no_address naming the network, and the
// allocation rows equal the VMs' addresses. On PostgreSQL two replicas
// share the database and split the requests.
func TestConcurrentCreatesExhaustASlash24Exactly(t *testing.T) {
	t.Run("postgres two replicas", func(t *testing.T) {
		url := testenv.PostgresURL(t)
		r1 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
		r2 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
		exhaustSlash24(t, []*testenv.Control{r1, r2})
	})
	t.Run("sqlite", func(t *testing.T) {
		exhaustSlash24(t, []*testenv.Control{testenv.StartControl(t, testenv.ControlOptions{})})
	})
}

func exhaustSlash24(t *testing.T, replicas []*testenv.Control) {
	const (
		creates = 300
		usable  = 253
	)
	ctx := ctxT(t)
	for i := range 4 {
		d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{VCPUs: 100, MemoryMiB: 100 * 1024})
		replicas[0].RegisterHost(t, fmt.Sprintf("host-%d", i), d.Address)
	}
	if _, err := replicas[0].Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24")); err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		addresses = map[string]string{}
		noAddr    int
		wg        sync.WaitGroup
	)
	for i := range creates {
		c := replicas[i%len(replicas)]
		wg.Go(func() {
			name := fmt.Sprintf("vm-%04d", i)
			vm, err := c.Client.CreateVM(ctx, vmOn(name, api.NetworkInterface{Network: "lan"}), "")
			mu.Lock()
			defer mu.Unlock()
			var e *client.Error
			switch {
			case err == nil:
				if other, dup := addresses[vm.IPv4Address]; dup {
					t.Errorf("address %s handed out to %s and %s", vm.IPv4Address, other, name)
				}
				addresses[vm.IPv4Address] = name
			case errors.As(err, &e) && e.Code == api.CodeNoAddress && strings.Contains(e.Message, `"lan"`):
				noAddr++
			default:
				t.Errorf("create %s: %v", name, err)
			}
		})
	}
	wg.Wait()
	if len(addresses) != usable || noAddr != creates-usable {
		t.Errorf("%d placed and %d no_address; want %d and %d", len(addresses), noAddr, usable, creates-usable)
	}
	if _, taken := addresses["10.20.0.1"]; taken {
		t.Error("the gateway address was handed out")
	}
	n, err := replicas[len(replicas)-1].Client.GetNetwork(ctx, "lan")
	if err != nil {
		t.Fatal(err)
	}
	if n.AddressesUsed != usable {
		t.Errorf("network counts %d addresses used, want %d", n.AddressesUsed, usable)
	}
	checkNICLedger(t, replicas[0].Store)
	checkLedger(t, replicas[0].Store)
}

// checkNICLedger asserts that the live NIC rows are exactly the NICs of the
// VMs that hold capacity: same MACs, same addresses, nothing left over.
func checkNICLedger(t *testing.T, st *store.Store) {
	t.Helper()
	ctx := context.Background()
	vms, err := st.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, vm := range vms {
		if !vm.HoldsCapacity {
			continue
		}
		for i, n := range vm.NICs {
			want[fmt.Sprintf("%s/%d/%s/%s/%d", vm.ID, i, n.Network, n.MACAddress, n.Address)] = true
		}
	}
	rows, err := st.LiveNICs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, r := range rows {
		got[fmt.Sprintf("%s/%d/%s/%s/%d", r.VMID, r.Index, r.Network, r.MACAddress, r.Address)] = true
	}
	for k := range want {
		if !got[k] {
			t.Errorf("VM NIC %s has no allocation row", k)
		}
	}
	for k := range got {
		if !want[k] {
			t.Errorf("allocation row %s belongs to no live VM NIC", k)
		}
	}
}

// A create that fails at the agent gives its address and MAC back with its
// capacity, and a bridge the host lacks is the agent's 400 naming both.
func TestFailedCreateReleasesItsAddress(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", agent.Address)
		if _, err := c.Client.CreateNetwork(ctx, natNet("lan", "10.20.0.0/24")); err != nil {
			t.Fatal(err)
		}
		agent.FailCreates(true)
		_, err := noRetry(c).CreateVM(ctx, vmOn("doomed", api.NetworkInterface{Network: "lan", IPv4Address: "10.20.0.9"}), "")
		if !errors.Is(err, client.ErrUnavailable) {
			t.Fatalf("create with a failing agent: %v, want unavailable", err)
		}
		if n, _ := c.Client.GetNetwork(ctx, "lan"); n.AddressesUsed != 0 {
			t.Errorf("a failed create left %d addresses used", n.AddressesUsed)
		}
		checkNICLedger(t, c.Store)
		agent.FailCreates(false)
		vm, err := noRetry(c).CreateVM(ctx, vmOn("doomed", api.NetworkInterface{Network: "lan", IPv4Address: "10.20.0.9"}), "")
		if err != nil || vm.IPv4Address != "10.20.0.9" {
			t.Errorf("the same fixed address after the agent recovered: %+v, %v", vm.NetworkInterfaces, err)
		}
	})
}

// The host monitor settles a create whose replica died after the agent
// answered, and takes the forwarded ports from the agent's report.
func TestMonitorRecordsForwardsOfAStuckCreate(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true, CreateGrace: time.Millisecond})
	agent := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
	c.RegisterHost(t, "h1", agent.Address)
	c.Service.SyncNow(ctx)
	vm, err := c.Client.CreateVM(ctx, vmOn("web", api.NetworkInterface{Network: "default",
		PortForwards: []api.PortForward{{GuestPort: 80}}}), "")
	if err != nil {
		t.Fatal(err)
	}
	// What a kill -9 between the agent's answer and its recording leaves.
	row, err := c.Store.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	row.NICs[0].PortForwards[0].HostAddress, row.NICs[0].PortForwards[0].HostPort = "", 0
	if err := c.Store.SetVMNICs(ctx, vm.ID, row.NICs); err != nil {
		t.Fatal(err)
	}
	if err := c.Store.SetVMState(ctx, vm.ID, api.StateCreating, "", ""); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // let the millisecond grace pass; no timing is asserted
	c.Service.SyncNow(ctx)
	got, err := c.Client.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := vm.NetworkInterfaces[0].PortForwards[0]
	if got.ObservedState != api.StateRunning || len(got.NetworkInterfaces) != 1 || len(got.NetworkInterfaces[0].PortForwards) != 1 ||
		got.NetworkInterfaces[0].PortForwards[0] != want {
		t.Errorf("settled VM: %s with %+v; want running with forward %+v", got.ObservedState, got.NetworkInterfaces, want)
	}
}

// Overlapping networks created at once on two replicas: exactly one wins,
// the others get 409 naming it.
func TestConcurrentOverlappingNetworksOneWins(t *testing.T) {
	url := testenv.PostgresURL(t)
	replicas := []*testenv.Control{
		testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url}),
		testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url}),
	}
	ctx := ctxT(t)
	const n = 12
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		won      []string
		conflict int
	)
	for i := range n {
		c := replicas[i%2]
		wg.Go(func() {
			// 10.20.0.0/24, /25, /26 ... all overlap each other.
			name := fmt.Sprintf("net-%d", i)
			_, err := c.Client.CreateNetwork(ctx, natNet(name, fmt.Sprintf("10.20.0.0/%d", 24+i%6)))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				won = append(won, name)
			case errors.Is(err, client.ErrConflict) && strings.Contains(err.Error(), "overlaps"):
				conflict++
			default:
				t.Errorf("create %s: %v", name, err)
			}
		})
	}
	wg.Wait()
	if len(won) != 1 || conflict != n-1 {
		t.Errorf("%d created (%v) and %d refused as overlapping; want 1 and %d", len(won), won, conflict, n-1)
	}
}

// A nat network's allow list: checked, kept sorted, shown, and passed to
// the agents with each NIC on the network (they open their fence for it).
func TestNetworkAllowReachesTheAgents(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		d := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", d.Address)
		ctx := ctxT(t)
		bad := []struct {
			name string
			in   api.NetworkCreate
			want string
		}{
			{"garbage cidr", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"10.1.0.0/33"}}, "IPv4 CIDR"},
			{"ipv6 cidr", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"fd00::/64"}}, "IPv4 CIDR"},
			{"host bits", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"192.168.1.5/24"}}, "192.168.1.0/24"},
			{"bad name", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"no spaces"}}, "neither"},
			{"itself", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"x"}}, "this network"},
			{"twice", api.NetworkCreate{Name: "x", Mode: api.NetworkNAT, CIDR: "10.30.0.0/24", Allow: []string{"a", "a"}}, "twice"},
			{"bridge mode", api.NetworkCreate{Name: "x", Mode: api.NetworkBridge, Bridge: "br0", Allow: []string{"a"}}, "only a nat network"},
			{"user mode", api.NetworkCreate{Name: "x", Mode: api.NetworkUser, Allow: []string{"10.0.0.0/8"}}, "only a nat network"},
		}
		for _, tc := range bad {
			_, err := c.Client.CreateNetwork(ctx, tc.in)
			var e *client.Error
			if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "allow") || !strings.Contains(e.Message, tc.want) {
				t.Errorf("%s: got %v; want 400 naming allow and %q", tc.name, err, tc.want)
			}
		}
		in := natNet("lan", "10.20.0.0/24")
		in.Allow = []string{"office", "192.168.10.0/24", "db"}
		want := []string{"192.168.10.0/24", "db", "office"}
		n, err := c.Client.CreateNetwork(ctx, in)
		if err != nil || !slices.Equal(n.Allow, want) {
			t.Fatalf("create with allow: %+v, %v; want allow %v", n, err, want)
		}
		if n, err = c.Client.GetNetwork(ctx, "lan"); err != nil || !slices.Equal(n.Allow, want) {
			t.Fatalf("get: allow %v, %v; want %v", n.Allow, err, want)
		}
		plain, err := c.Client.CreateNetwork(ctx, natNet("plain", "10.21.0.0/24"))
		if err != nil || plain.Allow == nil || len(plain.Allow) != 0 {
			t.Fatalf("a network without allow: %+v, %v; want allow []", plain, err)
		}
		vm, err := c.Client.CreateVM(ctx, vmOn("web", api.NetworkInterface{Network: "lan"}, api.NetworkInterface{Network: "plain"}), "")
		if err != nil {
			t.Fatal(err)
		}
		if asked := d.NICs(vm.ID); len(asked) != 2 || !slices.Equal(asked[0].Allow, want) || len(asked[1].Allow) != 0 {
			t.Errorf("agent was asked for %+v; want lan's NIC with allow %v, plain's without", asked, want)
		}
	})
}
