package network_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// overlayLab is a set of "hosts" (named network namespaces) joined by veths
// to an underlay bridge in the test's own namespace, 10.250.0.<i>/24 each,
// and "guests" (namespaces with a veth on a host's bridge).
type overlayLab struct {
	t      *testing.T
	prefix string
}

type overlayLabHost struct {
	ns       string
	underlay string
	net      *network.Host
}

type overlayLabGuest struct {
	ns, mac, ip string
}

func overlayRun(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func newOverlayLab(t *testing.T) *overlayLab {
	t.Helper()
	lab := &overlayLab{t: t, prefix: fmt.Sprintf("kvov%d", os.Getpid())}
	overlayRun(t, "ip", "link", "add", "ovul", "type", "bridge")
	overlayRun(t, "ip", "link", "set", "ovul", "up")
	return lab
}

// addNS makes a named namespace, removed at the end of the test (named
// namespaces outlive the test's own).
func (lab *overlayLab) addNS(name string) string {
	t := lab.t
	t.Helper()
	ns := lab.prefix + "-" + name
	overlayRun(t, "ip", "netns", "add", ns)
	t.Cleanup(func() { _ = netns.DeleteNamed(ns) })
	overlayRun(t, "ip", "-n", ns, "link", "set", "lo", "up")
	return ns
}

func (lab *overlayLab) host(i int) *overlayLabHost {
	t := lab.t
	t.Helper()
	h := &overlayLabHost{ns: lab.addNS(fmt.Sprintf("h%d", i)), underlay: fmt.Sprintf("10.250.0.%d", i), net: network.New(nil)}
	out := fmt.Sprintf("ovu%d", i)
	overlayRun(t, "ip", "link", "add", out, "master", "ovul", "type", "veth", "peer", "name", "eth0", "netns", h.ns)
	overlayRun(t, "ip", "link", "set", out, "up")
	overlayRun(t, "ip", "-n", h.ns, "addr", "add", h.underlay+"/24", "dev", "eth0")
	overlayRun(t, "ip", "-n", h.ns, "link", "set", "eth0", "up")
	h.in(t, func() error {
		u, err := network.FindUnderlay(h.underlay)
		if err != nil {
			return err
		}
		if u.Link != "eth0" || u.MTU != 1500 {
			return fmt.Errorf("underlay %+v; want eth0 with mtu 1500", u)
		}
		h.net.SetUnderlay(u)
		return nil
	})
	return h
}

func (h *overlayLabHost) in(t *testing.T, fn func() error) {
	t.Helper()
	if err := network.RunIn(h.ns, fn); err != nil {
		t.Fatalf("in host %s: %v", h.ns, err)
	}
}

func (h *overlayLabHost) put(t *testing.T, o agentapi.Overlay) agentapi.OverlayState {
	t.Helper()
	var st agentapi.OverlayState
	h.in(t, func() error {
		var err error
		st, err = h.net.PutOverlay(o)
		return err
	})
	return st
}

func (h *overlayLabHost) list(t *testing.T) []agentapi.OverlayState {
	t.Helper()
	var out []agentapi.OverlayState
	h.in(t, func() error {
		var err error
		out, err = h.net.ListOverlays()
		return err
	})
	return out
}

// guest puts a namespace with address ip/24 and mac on the bridge of
// network on host h, and serves its name on TCP port 7000 there.
func (lab *overlayLab) guest(h *overlayLabHost, name, netName, mac, ip, gw string) overlayLabGuest {
	t := lab.t
	t.Helper()
	g := overlayLabGuest{ns: lab.addNS(name), mac: mac, ip: ip}
	port := "ovg-" + name
	overlayRun(t, "ip", "-n", h.ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", g.ns)
	overlayRun(t, "ip", "-n", h.ns, "link", "set", port, "master", network.BridgeName(netName), "up")
	overlayRun(t, "ip", "-n", g.ns, "link", "set", "eth0", "address", mac, "mtu", "1450", "up")
	overlayRun(t, "ip", "-n", g.ns, "addr", "add", ip+"/24", "dev", "eth0")
	overlayRun(t, "ip", "-n", g.ns, "route", "add", "default", "via", gw)
	var ln net.Listener
	if err := network.RunIn(g.ns, func() error {
		var err error
		ln, err = net.Listen("tcp", ":7000")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "guest "+name)
			_ = c.Close()
		}
	}()
	return g
}

// reach says what from gets from port 7000 at addr ("" when nothing
// answers within the tries).
func (g overlayLabGuest) reach(t *testing.T, addr string, tries int) string {
	t.Helper()
	var got string
	for range tries {
		_ = network.RunIn(g.ns, func() error {
			c, err := net.DialTimeout("tcp", addr+":7000", 2*time.Second)
			if err != nil {
				return err
			}
			defer func() { _ = c.Close() }()
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			b, _ := io.ReadAll(c)
			got = string(b)
			return nil
		})
		if got != "" {
			return got
		}
	}
	return ""
}

func overlayEntry(g overlayLabGuest, h *overlayLabHost) agentapi.OverlayEntry {
	return agentapi.OverlayEntry{MAC: g.mac, IPv4: g.ip, Underlay: h.underlay}
}

func overlayPeers(hosts ...*overlayLabHost) []agentapi.OverlayPeer {
	var out []agentapi.OverlayPeer
	for _, h := range hosts {
		out = append(out, agentapi.OverlayPeer{Host: h.ns, Underlay: h.underlay})
	}
	return out
}

// overlayDenied is what the allow list of network on host h dropped.
func overlayDenied(t *testing.T, h *overlayLabHost, netName string) uint64 {
	t.Helper()
	fd, err := netns.GetFromName(h.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fd.Close() }()
	rules, err := network.ListFence(int(fd))
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	found := false
	for _, r := range rules {
		if r.Chain == "ovl-"+network.BridgeName(netName) && r.Tag == "deny non-peer" {
			n, found = r.Packets, true
		}
	}
	if !found {
		t.Fatalf("host %s: no deny non-peer rule of network %s in %+v", h.ns, netName, rules)
	}
	return n
}

const (
	ovCIDR = "10.200.1.0/24"
	ovGW   = "10.200.1.1"
)

// Four hosts: network a (vni 100) on hosts 1, 2 and 4, network b (vni 200,
// the same addresses) on host 3. Guests of a on hosts 1 and 2 reach each
// other through the tunnel; a guest of b whose host sends its frames to
// host 2 does not reach host 2's guest (another VNI); a guest of a on host
// 4, which host 2 does not list as a peer, does not either (its UDP 4789
// is dropped) until host 2 lists it. The kernel's entries read back equal
// what was put, after adds and deletes.
func TestOverlayGuestsReachAcrossHostsOnlyOnTheirVNIAndFromPeers(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	lab := newOverlayLab(t)
	h1, h2, h3, h4 := lab.host(1), lab.host(2), lab.host(3), lab.host(4)
	overlay := func(netName string, vni int, peers []agentapi.OverlayPeer, entries ...agentapi.OverlayEntry) agentapi.Overlay {
		return agentapi.Overlay{Network: netName, VNI: vni, CIDR: ovCIDR, Gateway: ovGW, MTU: 1450, Peers: peers, Entries: entries}
	}
	// The bridges first (guests need them), then the entries.
	for _, h := range []*overlayLabHost{h1, h2, h4} {
		h.put(t, overlay("a", 100, nil))
	}
	h3.put(t, overlay("b", 200, nil))
	g1 := lab.guest(h1, "g1", "a", "52:54:00:0a:00:01", "10.200.1.11", ovGW)
	g2 := lab.guest(h2, "g2", "a", "52:54:00:0a:00:02", "10.200.1.12", ovGW)
	g3 := lab.guest(h3, "g3", "b", "52:54:00:0b:00:03", "10.200.1.13", ovGW)
	g4 := lab.guest(h4, "g4", "a", "52:54:00:0a:00:04", "10.200.1.14", ovGW)

	st1 := h1.put(t, overlay("a", 100, overlayPeers(h2), overlayEntry(g2, h2)))
	h2.put(t, overlay("a", 100, overlayPeers(h1, h3), overlayEntry(g1, h1)))
	// Host 3's b and host 4's a both send g2's frames to host 2.
	h3.put(t, overlay("b", 200, overlayPeers(h2), overlayEntry(g2, h2)))
	h4.put(t, overlay("a", 100, overlayPeers(h2), overlayEntry(g2, h2)))

	want1 := agentapi.OverlayState{Network: "a", VNI: 100, Device: network.VXLANName("a"), Bridge: network.BridgeName("a"), MTU: 1450,
		FDB: []agentapi.OverlayFDB{{MAC: g2.mac, Dst: h2.underlay}}, Neigh: []agentapi.OverlayNeigh{{IPv4: g2.ip, MAC: g2.mac}}}
	if fmt.Sprint(st1) != fmt.Sprint(want1) {
		t.Fatalf("host 1 state = %+v\nwant %+v", st1, want1)
	}
	if l := h1.list(t); len(l) != 1 || fmt.Sprint(l[0]) != fmt.Sprint(want1) {
		t.Fatalf("host 1 lists %+v; want only %+v", l, want1)
	}
	h1.in(t, func() error {
		vx, err := netlink.LinkByName(network.VXLANName("a"))
		if err != nil {
			return err
		}
		v, ok := vx.(*netlink.Vxlan)
		if !ok || v.Learning || !v.Proxy || v.Port != 4789 || v.VxlanId != 100 || v.Attrs().MTU != 1450 || v.SrcAddr.String() != h1.underlay {
			return fmt.Errorf("vxlan device %+v; want vni 100, port 4789, local %s, no learning, proxy, mtu 1450", vx, h1.underlay)
		}
		br, err := netlink.LinkByName(network.BridgeName("a"))
		if err != nil || br.Attrs().MTU != 1450 {
			return fmt.Errorf("bridge %v (%v): want mtu 1450", br, err)
		}
		// Every forwarding entry with a tunnel destination, as the kernel
		// dumps it: only g2's, no all-zeros (flooding) one.
		all, err := netlink.NeighList(vx.Attrs().Index, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, n := range all {
			if n.HardwareAddr.String() == "00:00:00:00:00:00" {
				return fmt.Errorf("an all-zeros entry: %+v", n)
			}
		}
		return nil
	})

	if got := g1.reach(t, g2.ip, 5); got != "guest g2" {
		t.Fatalf("g1 (host 1) got %q from g2 (host 2); want its answer through the overlay", got)
	}
	if got := g2.reach(t, g1.ip, 5); got != "guest g1" {
		t.Fatalf("g2 (host 2) got %q from g1 (host 1)", got)
	}
	if got := g3.reach(t, g2.ip, 2); got != "" {
		t.Fatalf("g3 on vni 200 reached g2 on vni 100: %q", got)
	}
	before := overlayDenied(t, h2, "a")
	if got := g4.reach(t, g2.ip, 2); got != "" {
		t.Fatalf("g4 on a host that is not host 2's peer reached g2: %q", got)
	}
	if after := overlayDenied(t, h2, "a"); after <= before {
		t.Fatalf("host 2 dropped %d packets from non-peers, %d before g4 tried: want more", after, before)
	}
	// Host 2 lists host 4: its tunnel is let in.
	h2.put(t, overlay("a", 100, overlayPeers(h1, h3, h4), overlayEntry(g1, h1), overlayEntry(g4, h4)))
	if got := g4.reach(t, g2.ip, 5); got != "guest g2" {
		t.Fatalf("g4 got %q from g2 once host 2 lists host 4 as a peer", got)
	}

	// Adds and deletes: the kernel's entries follow exactly.
	ghost := agentapi.OverlayEntry{MAC: "52:54:00:0a:00:99", IPv4: "10.200.1.99", Underlay: h4.underlay}
	moved := overlayEntry(g2, h4) // g2 "migrated" to host 4
	st := h1.put(t, overlay("a", 100, overlayPeers(h2, h4), moved, ghost, overlayEntry(g4, h4)))
	wantFDB := []agentapi.OverlayFDB{{MAC: g2.mac, Dst: h4.underlay}, {MAC: g4.mac, Dst: h4.underlay}, {MAC: ghost.MAC, Dst: h4.underlay}}
	wantNeigh := []agentapi.OverlayNeigh{{IPv4: g2.ip, MAC: g2.mac}, {IPv4: g4.ip, MAC: g4.mac}, {IPv4: ghost.IPv4, MAC: ghost.MAC}}
	if !slices.Equal(st.FDB, wantFDB) || !slices.Equal(st.Neigh, wantNeigh) {
		t.Fatalf("after a move and adds: fdb %+v neigh %+v\nwant %+v %+v", st.FDB, st.Neigh, wantFDB, wantNeigh)
	}
	st = h1.put(t, overlay("a", 100, overlayPeers(h4), overlayEntry(g4, h4)))
	if !slices.Equal(st.FDB, wantFDB[1:2]) || !slices.Equal(st.Neigh, wantNeigh[1:2]) {
		t.Fatalf("after deletes: fdb %+v neigh %+v; want only g4's", st.FDB, st.Neigh)
	}
	if again := h1.put(t, overlay("a", 100, overlayPeers(h4), overlayEntry(g4, h4))); fmt.Sprint(again) != fmt.Sprint(st) {
		t.Fatalf("the same put again changed the state: %+v, before %+v", again, st)
	}

	// Delete: the vxlan device goes; the bridge stays while g1 is on it,
	// and goes with the next delete once g1's port is gone.
	h1.in(t, func() error { return h1.net.DeleteOverlay("a") })
	if l := h1.list(t); len(l) != 0 {
		t.Fatalf("host 1 lists %+v after the delete", l)
	}
	h1.in(t, func() error {
		if ok, err := network.BridgeExists(network.BridgeName("a")); !ok || err != nil {
			return fmt.Errorf("bridge of a gone (%v) while g1 is on it", err)
		}
		if err := netlink.LinkDel(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ovg-g1"}}); err != nil {
			return err
		}
		if err := h1.net.DeleteOverlay("a"); err != nil {
			return err
		}
		if ok, err := network.BridgeExists(network.BridgeName("a")); ok || err != nil {
			return fmt.Errorf("bridge of a still there (%v) after the last port and the overlay went", err)
		}
		return h1.net.DeleteOverlay("a") // nothing there: no error
	})
	fd, err := netns.GetFromName(h1.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fd.Close() }()
	if rules, err := network.ListFence(int(fd)); err != nil || len(rules) != 0 {
		t.Fatalf("host 1 fence after the delete: %+v (%v); want none", rules, err)
	}
}

func TestOverlayRefusesBadInputAndAHostWithoutUnderlay(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	lab := newOverlayLab(t)
	h := lab.host(1)
	good := agentapi.Overlay{Network: "a", VNI: 100, CIDR: ovCIDR, Gateway: ovGW, MTU: 1450,
		Entries: []agentapi.OverlayEntry{{MAC: "52:54:00:0a:00:02", IPv4: "10.200.1.12", Underlay: "10.250.0.2"}}}
	for name, change := range map[string]func(*agentapi.Overlay){
		"vni 0":              func(o *agentapi.Overlay) { o.VNI = 0 },
		"vni 2^24":           func(o *agentapi.Overlay) { o.VNI = 1 << 24 },
		"mtu over underlay":  func(o *agentapi.Overlay) { o.MTU = 1451 },
		"bad mac":            func(o *agentapi.Overlay) { o.Entries[0].MAC = "52:54:00:0a:00" },
		"all-zeros mac":      func(o *agentapi.Overlay) { o.Entries[0].MAC = "00:00:00:00:00:00" },
		"address off cidr":   func(o *agentapi.Overlay) { o.Entries[0].IPv4 = "10.200.2.12" },
		"own underlay entry": func(o *agentapi.Overlay) { o.Entries[0].Underlay = h.underlay },
		"bad peer":           func(o *agentapi.Overlay) { o.Peers = []agentapi.OverlayPeer{{Host: "x", Underlay: "10.250.0"}} },
	} {
		o := good
		o.Entries = slices.Clone(good.Entries)
		change(&o)
		err := network.RunIn(h.ns, func() error { _, err := h.net.PutOverlay(o); return err })
		if !errors.Is(err, network.ErrBadOverlay) {
			t.Errorf("%s: %v; want ErrBadOverlay", name, err)
		}
	}
	if l := h.list(t); len(l) != 0 {
		t.Fatalf("refused puts left %+v", l)
	}
	none := network.New(nil)
	if err := network.RunIn(h.ns, func() error { _, err := none.PutOverlay(good); return err }); !errors.Is(err, network.ErrNoUnderlay) {
		t.Fatalf("put without an underlay: %v; want ErrNoUnderlay", err)
	}
	if err := network.RunIn(h.ns, func() error { _, err := network.FindUnderlay("10.250.0.9"); return err }); err == nil ||
		!strings.Contains(err.Error(), "10.250.0.1") {
		t.Fatalf("an underlay address the host lacks: %v; want an error naming the addresses it has", err)
	}
}
