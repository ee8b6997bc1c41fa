package qemu_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// The overlay lab: "hosts" are named network namespaces joined by veths to
// an underlay bridge in the test's own namespace (192.0.2.0/24, TEST-NET-1,
// which the guests' fence lets them reach through NAT: the test's side,
// 192.0.2.254, plays the outside). Each host runs a real kvmd agent
// process (qemu driver) in its namespace, listening on its underlay
// address, with --underlay-address.
const (
	ovLabOutside   = "192.0.2.254"
	ovLabAgentPort = "8471"
)

type ovLabHost struct {
	name, ns, underlay, dir string
	client                  *agentapi.Client
	cmd                     *exec.Cmd
}

// ovLabStart makes the underlay bridge, the outside's HTTP server on it,
// and n hosts with an agent each.
func ovLabStart(t *testing.T, n int) []*ovLabHost {
	t.Helper()
	ovRun(t, "ip", "link", "add", "ovlab", "type", "bridge")
	ovRun(t, "ip", "addr", "add", ovLabOutside+"/24", "dev", "ovlab")
	ovRun(t, "ip", "link", "set", "ovlab", "up")
	ln, err := net.Listen("tcp", ovLabOutside+":80")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "kvm-test-outside\n")
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	bin := buildAgentBinary(t)
	var hosts []*ovLabHost
	for i := 1; i <= n; i++ {
		h := &ovLabHost{name: fmt.Sprintf("h%d", i), ns: fmt.Sprintf("kvovq%d-h%d", os.Getpid(), i),
			underlay: fmt.Sprintf("192.0.2.%d", i), dir: t.TempDir()}
		ovRun(t, "ip", "netns", "add", h.ns)
		t.Cleanup(func() { _ = netns.DeleteNamed(h.ns) })
		out := fmt.Sprintf("ovlab%d", i)
		ovRun(t, "ip", "link", "add", out, "master", "ovlab", "type", "veth", "peer", "name", "eth0", "netns", h.ns)
		ovRun(t, "ip", "link", "set", out, "up")
		ovRun(t, "ip", "-n", h.ns, "addr", "add", h.underlay+"/24", "dev", "eth0")
		ovRun(t, "ip", "-n", h.ns, "link", "set", "eth0", "up")
		ovRun(t, "ip", "-n", h.ns, "link", "set", "lo", "up")
		h.start(t, bin)
		t.Cleanup(func() {
			h.kill()
			for _, pid := range qemu.ProcessesUnder(h.dir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			// A forked child's namespace outlives the host's.
			vms, _ := os.ReadDir(h.dir + "/vms")
			for _, vm := range vms {
				_ = netns.DeleteNamed(network.NetNSName(h.dir + "/vms/" + vm.Name()))
			}
		})
		hosts = append(hosts, h)
	}
	return hosts
}

func ovRun(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (h *ovLabHost) address() string { return "http://" + h.underlay + ":" + ovLabAgentPort }

func (h *ovLabHost) start(t *testing.T, bin string) {
	t.Helper()
	h.cmd = exec.Command("ip", "netns", "exec", h.ns, bin, "agent", "--listen", h.underlay+":"+ovLabAgentPort,
		"--underlay-address", h.underlay, "--vcpus", "4", "--state-dir", h.dir, "--image-dir", testenv.GuestImageDir(t),
		"--accel", testenv.Accel(), "--token", "agent-token", "--log-level", "warn")
	h.cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	h.cmd.Stderr = os.Stderr
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.client = agentapi.NewClient(h.address(), "agent-token", agentapi.WithRetries(0))
	deadline := time.Now().Add(time.Minute)
	for {
		info, err := h.client.Info(context.Background())
		if err == nil {
			if info.UnderlayAddress != h.underlay || info.UnderlayMTU != 1500 {
				t.Fatalf("host %s: info underlay %q mtu %d; want %s and 1500", h.name, info.UnderlayAddress, info.UnderlayMTU, h.underlay)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent of host %s did not answer within a minute: %v", h.name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (h *ovLabHost) kill() {
	if h.cmd != nil && h.cmd.Process != nil {
		_ = h.cmd.Process.Kill()
		_ = h.cmd.Wait()
	}
}

// get fetches url from inside the host's namespace (where its guests'
// bridges are), retrying for up to wait, and returns the body of a 200.
func (h *ovLabHost) get(t *testing.T, url string, wait time.Duration) string {
	t.Helper()
	c := &http.Client{Timeout: 15 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network_, addr string) (net.Conn, error) {
			var conn net.Conn
			// The socket is made on a thread in the namespace, and
			// stays there.
			err := network.RunIn(h.ns, func() error {
				var err error
				conn, err = (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, network_, addr)
				return err
			})
			return conn, err
		}}}
	return getWith(t, c, "host "+h.name+": ", url, wait)
}

// waitGuestIP waits for "kvm-guest-ip <address>" on the console of vm.
func (h *ovLabHost) waitGuestIP(t *testing.T, id string) string {
	t.Helper()
	re := regexp.MustCompile(`(?m)^kvm-guest-ip (\S+)\r?\n`)
	deadline := time.Now().Add(bootWait)
	var con string
	for time.Now().Before(deadline) {
		var err error
		if con, err = h.client.Console(context.Background(), id); err == nil {
			if m := re.FindStringSubmatch(con); m != nil {
				return m[1]
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("vm %s on host %s printed no kvm-guest-ip within %s; console:\n%s", id, h.name, bootWait, con)
	return ""
}

// links are the agent's links of network netName in the host's namespace
// (its bridge and vxlan device) that exist.
func (h *ovLabHost) links(t *testing.T, netName string) []string {
	t.Helper()
	ns, err := netns.GetFromName(h.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ns.Close() }()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer nh.Close()
	var out []string
	for _, name := range []string{network.BridgeName(netName), network.VXLANName(netName)} {
		if _, err := nh.LinkByName(name); err == nil {
			out = append(out, name)
		}
	}
	return out
}

type ovLabVM struct {
	id  string
	nic agentapi.NIC
	on  *ovLabHost
}

func ovLabNIC(netName string, vni int, cidr, gw, mac, ip string) agentapi.NIC {
	return agentapi.NIC{Network: netName, Mode: agentapi.NetworkOverlay, MACAddress: mac, CIDR: cidr, Gateway: gw,
		DHCP: true, IPv4Address: ip, VNI: vni, MTU: 1450}
}

// ovLabPush does what the control plane's host monitor does: for each
// host and each overlay network with a VM there, PUT the NICs of the
// network on the other hosts and the other hosts that have it; DELETE
// the overlays a host lists and no longer has.
func ovLabPush(t *testing.T, hosts []*ovLabHost, vms []ovLabVM) {
	t.Helper()
	ctx := context.Background()
	for _, h := range hosts {
		here := map[string]agentapi.NIC{}
		for _, v := range vms {
			if v.on == h {
				here[v.nic.Network] = v.nic
			}
		}
		for netName, n := range here {
			o := agentapi.Overlay{Network: netName, VNI: n.VNI, CIDR: n.CIDR, Gateway: n.Gateway, MTU: n.MTU,
				Peers: []agentapi.OverlayPeer{}, Entries: []agentapi.OverlayEntry{}}
			peers := map[*ovLabHost]bool{}
			for _, v := range vms {
				if v.on != h && v.nic.Network == netName {
					o.Entries = append(o.Entries, agentapi.OverlayEntry{MAC: v.nic.MACAddress, IPv4: v.nic.IPv4Address, Underlay: v.on.underlay})
					if !peers[v.on] {
						peers[v.on] = true
						o.Peers = append(o.Peers, agentapi.OverlayPeer{Host: v.on.name, Underlay: v.on.underlay})
					}
				}
			}
			st, err := h.client.PutOverlay(ctx, netName, o)
			if err != nil {
				t.Fatalf("host %s: put overlay %s: %v", h.name, netName, err)
			}
			if len(st.FDB) != len(o.Entries) || len(st.Neigh) != len(o.Entries) {
				t.Fatalf("host %s: overlay %s reads back %+v; want %d entries", h.name, netName, st, len(o.Entries))
			}
		}
		list, err := h.client.ListOverlays(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range list {
			if _, ok := here[st.Network]; !ok {
				if err := h.client.DeleteOverlay(ctx, st.Network); err != nil {
					t.Fatalf("host %s: delete overlay %s: %v", h.name, st.Network, err)
				}
			}
		}
	}
}

// Three hosts, an agent each: VMs of overlay network blue on the three get
// their addresses and reach each other and the outside through their
// host's gateway; a VM of overlay network red reaches none of them; the
// delete of the last VM of blue on a host removes its bridge, vxlan device
// and entries there, and the others still reach each other.
func TestOverlayGuestsOnThreeHostAgentsReachEachOther(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	ctx := context.Background()
	hosts := ovLabStart(t, 3)
	const blueCIDR, blueGW, redCIDR, redGW = "10.220.0.0/24", "10.220.0.1", "10.221.0.0/24", "10.221.0.1"
	vms := []ovLabVM{
		{"b1", ovLabNIC("blue", 4100, blueCIDR, blueGW, "52:54:00:b1:00:01", "10.220.0.11"), hosts[0]},
		{"b2", ovLabNIC("blue", 4100, blueCIDR, blueGW, "52:54:00:b1:00:02", "10.220.0.12"), hosts[1]},
		{"b3", ovLabNIC("blue", 4100, blueCIDR, blueGW, "52:54:00:b1:00:03", "10.220.0.13"), hosts[2]},
		{"r1", ovLabNIC("red", 4200, redCIDR, redGW, "52:54:00:e1:00:01", "10.221.0.21"), hosts[1]},
	}
	for _, v := range vms {
		spec := guest
		spec.NICs = []agentapi.NIC{v.nic}
		if _, err := v.on.client.CreateVM(ctx, v.id, spec); err != nil {
			t.Fatalf("create %s on %s: %v", v.id, v.on.name, err)
		}
	}
	ovLabPush(t, hosts, vms)
	for _, v := range vms {
		if got := v.on.waitGuestIP(t, v.id); got != v.nic.IPv4Address {
			t.Fatalf("vm %s printed address %s; its nic says %s", v.id, got, v.nic.IPv4Address)
		}
	}
	ovLabReach(t, "three hosts", vms[:3])
	ovLabUnreached(t, vms[3], vms[:3])

	// The last VM of blue on host 3 goes: its bridge, vxlan device and
	// entries go with it, and the other hosts drop its entries.
	if err := hosts[2].client.DeleteVM(ctx, "b3"); err != nil {
		t.Fatal(err)
	}
	if l := hosts[2].links(t, "blue"); len(l) != 0 {
		t.Fatalf("host 3 still has %v of blue after its last vm went", l)
	}
	ovLabPush(t, hosts, []ovLabVM{vms[0], vms[1], vms[3]})
	if list, err := hosts[2].client.ListOverlays(ctx); err != nil || len(list) != 0 {
		t.Fatalf("host 3 lists %+v (%v) after its last vm went", list, err)
	}
	for _, h := range hosts[:2] {
		list, err := h.client.ListOverlays(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range list {
			for _, f := range st.FDB {
				if f.Dst == hosts[2].underlay {
					t.Fatalf("host %s still sends %s to host 3: %+v", h.name, f.MAC, st)
				}
			}
		}
	}
	ovLabReach(t, "after host 3 left blue", vms[:2])
}

// ovLabReach checks that each VM of blue answers at its address on its
// host, fetches the page of every other one (across the overlay) and the
// outside (through its host's gateway).
func ovLabReach(t *testing.T, phase string, blue []ovLabVM) {
	t.Helper()
	for _, v := range blue {
		base := "http://" + v.nic.IPv4Address
		if body := v.on.get(t, base+"/", time.Minute); !strings.Contains(body, "kvm-guest "+v.id+" "+v.nic.IPv4Address) {
			t.Fatalf("%s: %s on %s answered %q", phase, v.id, v.on.name, body)
		}
		for _, o := range blue {
			if o.id == v.id {
				continue
			}
			want := "kvm-guest " + o.id + " " + o.nic.IPv4Address
			if body := v.on.get(t, base+"/cgi-bin/get?"+o.nic.IPv4Address, time.Minute); !strings.Contains(body, want) {
				t.Fatalf("%s: %s (host %s) fetching from %s (host %s) got %q", phase, v.id, v.on.name, o.id, o.on.name, body)
			}
		}
		if body := v.on.get(t, base+"/cgi-bin/get?"+ovLabOutside, time.Minute); !strings.Contains(body, "kvm-test-outside") {
			t.Fatalf("%s: %s fetching from the outside through its gateway got %q", phase, v.id, body)
		}
	}
}

// ovLabUnreached checks that v fetches from none of others.
func ovLabUnreached(t *testing.T, v ovLabVM, others []ovLabVM) {
	t.Helper()
	for _, o := range others {
		body := v.on.get(t, "http://"+v.nic.IPv4Address+"/cgi-bin/get?"+o.nic.IPv4Address, time.Minute)
		if strings.Contains(body, "kvm-guest ") || !strings.Contains(body, "kvm-guest-fetch failed") {
			t.Fatalf("%s (network %s) fetching from %s (network %s, host %s) got %q; want a failed fetch",
				v.id, v.nic.Network, o.id, o.nic.Network, o.on.name, body)
		}
	}
}

// ovLabWait polls cond (bounded) until it returns nil.
func ovLabWait(t *testing.T, what string, wait time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for i := 0; ; i++ {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) || i > 8000 {
			t.Fatalf("%s: not within %s: %v", what, wait, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Issue 28's must-show with real guests: three hosts (namespaces on a
// veth underlay, a kvmd agent process each) registered with their
// underlay addresses in a control plane, which places the VMs and pushes
// the tunnels' entries. The VMs of overlay network blue on the three
// hosts get distinct addresses from its IPAM and each reaches the two
// others and the outside through its gateway; the VM of overlay network
// red reaches none of them; deleting blue's last VM on a host removes its
// bridge, vxlan device and entries there, and the other hosts' entries
// for it.
func TestOverlayControlPlaneGuestsOnThreeHostsReachEachOther(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	ctx := context.Background()
	hosts := ovLabStart(t, 3)
	// A loaded machine (TCG guests, make test's other packages) slows the
	// agents' answers: the hosts stay alive through it.
	c := testenv.StartControl(t, testenv.ControlOptions{AllowInsecureAgents: true, AgentTimeout: 30 * time.Second, DeadAfter: 20})
	byName := map[string]*ovLabHost{}
	for _, h := range hosts {
		in := api.HostPut{Address: h.address(), UnderlayAddress: h.underlay}
		if h.name == "h3" {
			in.Labels = map[string]string{"ovspill": "yes"} // where the fork's child goes
		}
		got, err := c.Client.PutHost(ctx, h.name, in)
		if err != nil {
			t.Fatalf("register %s: %v", h.name, err)
		}
		if got.UnderlayAddress != h.underlay {
			t.Fatalf("host %s answers underlay %q; want %s", h.name, got.UnderlayAddress, h.underlay)
		}
		byName[h.name] = h
	}
	for _, n := range []api.NetworkCreate{
		{Name: "blue", Mode: "overlay", CIDR: "10.220.0.0/24"},
		{Name: "red", Mode: "overlay", CIDR: "10.221.0.0/24"},
	} {
		if _, err := c.Client.CreateNetwork(ctx, n); err != nil {
			t.Fatalf("create network %s: %v", n.Name, err)
		}
	}
	var created []ovLabVM
	create := func(name, netName, host string) ovLabVM {
		t.Helper()
		start := time.Now()
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: guest.Image, VCPUs: guest.VCPUs, MemoryMiB: guest.MemoryMiB,
			DiskMiB: guest.DiskMiB, Host: host, NetworkInterfaces: []api.NetworkInterface{{Network: netName}}}, "")
		if err != nil {
			t.Fatalf("create %s on %s: %v", name, host, err)
		}
		answered := time.Since(start)
		// How long the new NIC's entries take to reach every other host
		// that has the network (the control plane pushes on the create).
		mac := vm.NetworkInterfaces[0].MACAddress
		for _, o := range created {
			if o.nic.Network != netName || o.on == byName[vm.Host] {
				continue
			}
			ovLabWait(t, "the entry of "+name+" on host "+o.on.name, time.Minute, func() error {
				list, err := o.on.client.ListOverlays(ctx)
				if err != nil {
					return err
				}
				for _, st := range list {
					if slices.ContainsFunc(st.FDB, func(f agentapi.OverlayFDB) bool { return f.MAC == mac }) {
						return nil
					}
				}
				return fmt.Errorf("not in %+v", list)
			})
			t.Logf("measure: the entry of %s (host %s) reached host %s %v after the create was sent (the create answered after %v)",
				name, vm.Host, o.on.name, time.Since(start).Round(time.Millisecond), answered.Round(time.Millisecond))
		}
		ovLabWait(t, "vm "+name+" running", bootWait, func() error {
			if vm, err = c.Client.GetVM(ctx, vm.ID); err == nil && vm.ObservedState != api.StateRunning {
				err = fmt.Errorf("observed %s (%s)", vm.ObservedState, vm.Reason)
			}
			return err
		})
		n := vm.NetworkInterfaces[0]
		v := ovLabVM{id: vm.ID, on: byName[vm.Host], nic: agentapi.NIC{Network: netName, MACAddress: n.MACAddress, IPv4Address: n.IPv4Address}}
		created = append(created, v)
		return v
	}
	blue := []ovLabVM{create("b1", "blue", "h1"), create("b2", "blue", "h2"), create("b3", "blue", "h3")}
	red := create("r1", "red", "h2")
	seen := map[string]bool{}
	for _, v := range append(slices.Clone(blue), red) {
		if v.on == nil || seen[v.nic.IPv4Address] {
			t.Fatalf("vm %s: host %v, address %s (seen before: %v)", v.id, v.on, v.nic.IPv4Address, seen[v.nic.IPv4Address])
		}
		seen[v.nic.IPv4Address] = true
		if got := v.on.waitGuestIP(t, v.id); got != v.nic.IPv4Address {
			t.Fatalf("vm %s printed address %s; the control plane gave it %s", v.id, got, v.nic.IPv4Address)
		}
	}
	// Each host has the other hosts' blue NICs (the control plane's push).
	ovLabWait(t, "blue's entries on every host", time.Minute, func() error {
		for _, v := range blue {
			list, err := v.on.client.ListOverlays(ctx)
			if err != nil {
				return err
			}
			if !slices.ContainsFunc(list, func(st agentapi.OverlayState) bool {
				return st.Network == "blue" && len(st.FDB) == 2 && len(st.Neigh) == 2
			}) {
				return fmt.Errorf("host %s lists %+v", v.on.name, list)
			}
		}
		return nil
	})
	ovLabReach(t, "three hosts", blue)
	ovLabUnreached(t, red, blue)

	// Agent and control-plane restarts. With the control plane stopped (no
	// push can put back what a restart took away), h2's agent is killed
	// with SIGKILL and started again on its state directory: every host's
	// tunnels and entries, read back from the kernels, are as they were.
	// The control plane starts again on its database: after one of its
	// monitor's rounds, still as they were, and the guests still reach
	// each other and nothing of red.
	before := ovRestartOverlays(t, hosts)
	c.Stop()
	hosts[1].kill()
	hosts[1].start(t, buildAgentBinary(t))
	if got := ovRestartOverlays(t, hosts); !reflect.DeepEqual(got, before) {
		t.Fatalf("h2's agent restart changed the overlays:\n got  %+v\n want %+v", got, before)
	}
	c = testenv.StartControl(t, testenv.ControlOptions{AllowInsecureAgents: true, DataDir: c.DataDir, SyncInterval: time.Second,
		AgentTimeout: 30 * time.Second, DeadAfter: 20})
	c.Service.SyncNow(ctx) // one monitor round, which pushes every overlay
	if got := ovRestartOverlays(t, hosts); !reflect.DeepEqual(got, before) {
		t.Fatalf("the control plane's restart changed the overlays:\n got  %+v\n want %+v", got, before)
	}
	ovLabReach(t, "after the agent's and the control plane's restarts", blue)
	ovLabUnreached(t, red, blue)

	// A fork child on another host answers at its own address: b1 (h1) is
	// forked with its source paused (so only the child can answer) and
	// its child placed on h3; b2 (h2) fetches the page at the child's own
	// address across the overlay.
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: blue[0].id, Count: 1, PauseSource: true,
		Constraints: &api.Constraints{HostLabels: map[string]string{"ovspill": "yes"}}}, "")
	if err != nil {
		t.Fatalf("fork b1: %v", err)
	}
	if f.Phase != api.ForkReady || len(f.Children) != 1 || f.Children[0].Host != "h3" {
		t.Fatalf("fork = %+v; want ready with one child on h3", f)
	}
	child := f.Children[0].NetworkInterfaces[0]
	if child.IPv4Address == "" || seen[child.IPv4Address] {
		t.Fatalf("fork child's address %q is empty or another vm's", child.IPv4Address)
	}
	want := "kvm-guest " + blue[0].id + " " + blue[0].nic.IPv4Address // the source's page, in the child's memory
	// (The child's entries reach h2 with the push the fork's commit kicks.)
	var body string
	for i := 0; i < 20 && !strings.Contains(body, want); i++ {
		body = blue[1].on.get(t, "http://"+blue[1].nic.IPv4Address+"/cgi-bin/get?"+child.IPv4Address, time.Minute)
	}
	if !strings.Contains(body, want) {
		t.Fatalf("b2 (h2) fetching from the fork child at %s (mac %s, h3) got %q; want %q\noverlays: %+v",
			child.IPv4Address, child.MACAddress, body, want, ovRestartOverlays(t, hosts))
	}
	t.Logf("b2 on h2 reached b1's fork child on h3 at its own address %s (source paused)", child.IPv4Address)
	if _, err := hosts[0].client.Action(ctx, blue[0].id, agentapi.ActionResume); err != nil {
		t.Fatalf("resume b1: %v", err)
	}
	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}

	// A migrated VM keeps its address and is reached at it from the other
	// hosts: b2 moves live from h2 to h1 (b1 cannot: its disk sits on the
	// fork's snapshot); its entries follow it with the push the switch
	// kicks. Measured: from the migration's answer (the VM runs on h1) to
	// b3 (h3) fetching b2's page at its address.
	if _, err := c.Client.MigrateVM(ctx, blue[1].id, "h1"); err != nil {
		t.Fatalf("migrate b2 to h1: %v", err)
	}
	switched := time.Now()
	blue[1].on = hosts[0]
	want = "kvm-guest " + blue[1].id + " " + blue[1].nic.IPv4Address
	if body := blue[2].on.get(t, "http://"+blue[2].nic.IPv4Address+"/cgi-bin/get?"+blue[1].nic.IPv4Address, time.Minute); !strings.Contains(body, want) {
		t.Fatalf("b3 (h3) fetching from b2 at %s after its migration to h1 got %q; want %q", blue[1].nic.IPv4Address, body, want)
	}
	t.Logf("measure: b2 migrated to h1 answered b3 (h3) at its address %s %s after the migration's answer",
		blue[1].nic.IPv4Address, time.Since(switched).Round(time.Millisecond))
	ovLabReach(t, "after b2 migrated to h1", blue)
	ovLabUnreached(t, red, blue)

	if err := c.Client.DeleteVM(ctx, blue[2].id); err != nil {
		t.Fatal(err)
	}
	h3 := blue[2].on
	ovLabWait(t, "host 3 without blue", time.Minute, func() error {
		if l := h3.links(t, "blue"); len(l) != 0 {
			return fmt.Errorf("links %v", l)
		}
		if list, err := h3.client.ListOverlays(ctx); err != nil || len(list) != 0 {
			return fmt.Errorf("lists %+v (%v)", list, err)
		}
		for _, v := range blue[:2] {
			list, err := v.on.client.ListOverlays(ctx)
			if err != nil {
				return err
			}
			for _, st := range list {
				for _, f := range st.FDB {
					if f.Dst == h3.underlay {
						return fmt.Errorf("host %s still sends %s to host 3", v.on.name, f.MAC)
					}
				}
			}
		}
		return nil
	})
	ovLabReach(t, "after host 3 left blue", blue[:2])

	// Throughput: a guest on h3 serves a file of random bytes; a guest on
	// h1 (across the overlay) and a guest on h3 (the same bridge) fetch it
	// in turn, three times each, timed in the guest. (h3 has room again:
	// b3 went.) Every guest runs at the overlay's MTU, from its DHCP lease
	// (option 26): at 1500 a full-size frame does not pass the 1450 bridge.
	mk := func(name, host string) ovLabVM {
		t.Helper()
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: guest.Image, VCPUs: guest.VCPUs, MemoryMiB: guest.MemoryMiB,
			DiskMiB: guest.DiskMiB, Host: host, NetworkInterfaces: []api.NetworkInterface{{Network: "blue"}}, UserData: ovPerfUserData}, "")
		if err != nil {
			t.Fatalf("create %s on %s: %v", name, host, err)
		}
		n := vm.NetworkInterfaces[0]
		return ovLabVM{id: vm.ID, on: byName[vm.Host], nic: agentapi.NIC{Network: "blue", MACAddress: n.MACAddress, IPv4Address: n.IPv4Address}}
	}
	srv, cross, same := mk("perf-srv", "h3"), mk("perf-cross", "h1"), mk("perf-same", "h3")
	for _, v := range []ovLabVM{srv, cross, same} {
		ovPerfWaitReady(t, v)
		con, err := v.on.client.Console(ctx, v.id)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(con, "kvm-guest-mtu 1450") {
			t.Errorf("vm %s on %s did not take the overlay's MTU 1450 from its lease; console:\n%s", v.id, v.on.name, con)
		}
	}
	var across, local []float64
	for range 3 {
		across = append(across, ovPerfPull(t, cross, srv))
		local = append(local, ovPerfPull(t, same, srv))
	}
	slices.Sort(across)
	slices.Sort(local)
	t.Logf("measure: TCP throughput guest to guest, %d MiB, p50: across hosts (h1 -> h3, vxlan) %.1f MB/s (runs %.1f), "+
		"on one host (h3's bridge) %.1f MB/s (runs %.1f): ratio %.2f", ovPerfMiB, across[1], across, local[1], local, across[1]/local[1])
}

// ovPerfMiB is the size of the file the throughput guests fetch.
const ovPerfMiB = 16

// ovPerfUserData makes /www/big (random bytes) and /cgi-bin/pull?<ip>,
// which starts a fetch of http://<ip>/big in the background and answers at
// once; when the fetch ends, /result says "kvm-ovperf <bytes>
// <centiseconds>", timed from the guest's uptime.
var ovPerfUserData = fmt.Sprintf(`#!/bin/sh
dd if=/dev/urandom of=/www/big.tmp bs=1048576 count=%d 2>/dev/null && mv /www/big.tmp /www/big
cat >/etc/ovperf-pull <<'PULL'
#!/bin/sh
t0=$(cut -d' ' -f1 /proc/uptime)
n=$(printf 'GET /big HTTP/1.0\r\nHost: x\r\n\r\n' | nc -w 10 "$1" 80 | wc -c)
t1=$(cut -d' ' -f1 /proc/uptime)
echo "kvm-ovperf $n $(( (${t1%%.*} * 100 + 1${t1##*.}) - (${t0%%.*} * 100 + 1${t0##*.}) ))" >/www/result.tmp
mv /www/result.tmp /www/result
PULL
chmod 755 /etc/ovperf-pull
cat >/www/cgi-bin/pull <<'PULL'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
case "$QUERY_STRING" in "" | *[!0-9.]*) echo "kvm-ovperf bad target"; exit 0 ;; esac
rm -f /www/result
/etc/ovperf-pull "$QUERY_STRING" </dev/null >/dev/null 2>&1 &
echo "kvm-ovperf started"
PULL
chmod 755 /www/cgi-bin/pull
echo kvm-ovperf-ready
`, ovPerfMiB)

func ovPerfWaitReady(t *testing.T, v ovLabVM) {
	t.Helper()
	ovLabWait(t, "vm "+v.id+" ready for the throughput runs", 3*bootWait, func() error {
		con, err := v.on.client.Console(context.Background(), v.id)
		if err != nil {
			return err
		}
		if !strings.Contains(con, "kvm-ovperf-ready") || !strings.Contains(con, "kvm-guest-ip ") {
			return fmt.Errorf("not ready yet")
		}
		return nil
	})
}

// ovPerfPull has client fetch srv's file and answers the rate in MB/s.
func ovPerfPull(t *testing.T, client, srv ovLabVM) float64 {
	t.Helper()
	base := "http://" + client.nic.IPv4Address
	if body := client.on.get(t, base+"/cgi-bin/pull?"+srv.nic.IPv4Address, time.Minute); !strings.Contains(body, "kvm-ovperf started") {
		t.Fatalf("%s starting its pull from %s: %q", client.id, srv.id, body)
	}
	body := client.on.get(t, base+"/result", 2*time.Minute) // 404 until the fetch ends
	var n, cs int64
	if _, err := fmt.Sscanf(strings.TrimSpace(body), "kvm-ovperf %d %d", &n, &cs); err != nil {
		con, _ := client.on.client.Console(context.Background(), client.id)
		t.Fatalf("%s pulling from %s: %q: %v; console:\n%s", client.id, srv.id, body, err, con)
	}
	if n < ovPerfMiB<<20 || cs <= 0 {
		t.Fatalf("%s pulled %d bytes in %d cs from %s; want the %d MiB file", client.id, n, cs, srv.id, ovPerfMiB)
	}
	return float64(n) / 1e6 / (float64(cs) / 100)
}

// ovRestartOverlays is every host's overlays as its agent reads them back
// from the kernel, by host.
func ovRestartOverlays(t *testing.T, hosts []*ovLabHost) map[string][]agentapi.OverlayState {
	t.Helper()
	out := map[string][]agentapi.OverlayState{}
	for _, h := range hosts {
		list, err := h.client.ListOverlays(context.Background())
		if err != nil {
			t.Fatalf("host %s: list overlays: %v", h.name, err)
		}
		slices.SortFunc(list, func(a, b agentapi.OverlayState) int { return strings.Compare(a.Network, b.Network) })
		out[h.name] = list
	}
	return out
}
