package network

// Overlay networks (agentapi/overlay.go): a nat network's bridge, gateway,
// masquerade and fence on every host that has the network, plus a VXLAN
// port on the bridge that carries the segment to the other hosts:
//
//	kvx-<hash of network>   the network's vxlan device, a port of its kvb- bridge
//
// The device learns nothing and floods nothing: it has no all-zeros
// forwarding entry, so broadcast and unknown unicast (DHCP among them)
// never leave the host. The control plane names every NIC of the network
// on the other hosts, and the device gets, for each, a forwarding entry
// (MAC -> that host's underlay address) and a neighbour entry (address ->
// MAC), which its ARP proxy answers the guests' ARP from. The network's
// name is the device's alias, so that what the kernel holds is read back
// as it is (ListOverlays), also by a new agent.

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// VXLANPrefix names the vxlan devices of overlay networks.
const VXLANPrefix = "kvx-"

// VXLANName is the vxlan device of an overlay network (15 bytes at most).
func VXLANName(network string) string { return VXLANPrefix + hash("vxlan", network)[:11] }

const overlayAliasPrefix = "kvmd overlay "

// Errors of overlays a caller can test with errors.Is.
var (
	// ErrNoUnderlay: the host has no underlay address (the agent was
	// started without --underlay-address).
	ErrNoUnderlay = errors.New("no underlay address")
	// ErrBadOverlay: the overlay's description is not valid (or does not
	// fit the underlay).
	ErrBadOverlay = errors.New("bad overlay")
)

// Underlay is the host's address that VXLAN tunnels start from, the
// interface that holds it and that interface's MTU.
type Underlay struct {
	Addr netip.Addr
	Link string
	MTU  int
}

// FindUnderlay checks that addr (IPv4) is an address of one of this host's
// interfaces and returns it with the interface.
func FindUnderlay(addr string) (Underlay, error) {
	a, err := netip.ParseAddr(addr)
	if err != nil || !a.Is4() || a.IsLoopback() || a.IsUnspecified() || a.IsMulticast() {
		return Underlay{}, fmt.Errorf("underlay address %q is not a unicast IPv4 address", addr)
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return Underlay{}, fmt.Errorf("list the host's addresses: %w", err)
	}
	var have []string
	for _, x := range addrs {
		got, ok := netip.AddrFromSlice(x.IP)
		if !ok {
			continue
		}
		if got.Unmap() != a {
			have = append(have, got.Unmap().String())
			continue
		}
		l, err := netlink.LinkByIndex(x.LinkIndex)
		if err != nil {
			return Underlay{}, fmt.Errorf("look up the interface of underlay address %s: %w", a, err)
		}
		return Underlay{Addr: a, Link: l.Attrs().Name, MTU: l.Attrs().MTU}, nil
	}
	return Underlay{}, fmt.Errorf("underlay address %s is on none of this host's interfaces (it has %s): "+
		"give --underlay-address an address of the interface that reaches the other hosts", a, strings.Join(have, ", "))
}

// SetUnderlay sets the host's underlay: overlay NICs and PutOverlay need it.
func (h *Host) SetUnderlay(u Underlay) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.underlay = u
}

// Underlay is the host's underlay (zero without one).
func (h *Host) Underlay() Underlay {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.underlay
}

// overlayMTU is n's MTU (the default when 0), checked against the underlay.
func overlayMTU(network string, mtu int, u Underlay) (int, error) {
	if mtu == 0 {
		mtu = agentapi.OverlayMTUDefault
	}
	if mtu < agentapi.OverlayMTUMin || mtu > agentapi.OverlayMTUMax {
		return 0, fmt.Errorf("%w: network %s: mtu %d is not between %d and %d", ErrBadOverlay, network, mtu,
			agentapi.OverlayMTUMin, agentapi.OverlayMTUMax)
	}
	if u.MTU > 0 && mtu > u.MTU-agentapi.OverlayOverhead {
		return 0, fmt.Errorf("%w: network %s: mtu %d does not fit the underlay: interface %s has mtu %d, "+
			"which leaves %d after the %d bytes of VXLAN: give the network an mtu of at most %d", ErrBadOverlay, network, mtu,
			u.Link, u.MTU, u.MTU-agentapi.OverlayOverhead, agentapi.OverlayOverhead, u.MTU-agentapi.OverlayOverhead)
	}
	return mtu, nil
}

// overlayShape is a checked Overlay.
type overlayShape struct {
	network string
	vni     int
	cidr    netip.Prefix
	gw      netip.Addr
	mtu     int
	fence   Fence
	peers   []netip.Addr
	fdb     map[string]netip.Addr // mac -> underlay
	neigh   map[netip.Addr]string // address -> mac
}

func checkOverlay(o agentapi.Overlay, u Underlay) (overlayShape, error) {
	bad := func(format string, args ...any) (overlayShape, error) {
		return overlayShape{}, fmt.Errorf("%w: network %s: %s", ErrBadOverlay, o.Network, fmt.Sprintf(format, args...))
	}
	s := overlayShape{network: o.Network, vni: o.VNI, fdb: map[string]netip.Addr{}, neigh: map[netip.Addr]string{}}
	if o.Network == "" {
		return bad("no network name")
	}
	if o.VNI < agentapi.OverlayVNIMin || o.VNI > agentapi.OverlayVNIMax {
		return bad("vni %d is not between %d and %d", o.VNI, agentapi.OverlayVNIMin, agentapi.OverlayVNIMax)
	}
	var err error
	if s.cidr, err = netip.ParsePrefix(o.CIDR); err != nil || !s.cidr.Addr().Is4() || s.cidr != s.cidr.Masked() {
		return bad("cidr %q is not an IPv4 network like 10.20.0.0/24", o.CIDR)
	}
	if s.gw, err = netip.ParseAddr(o.Gateway); err != nil || !s.cidr.Contains(s.gw) || s.gw == s.cidr.Addr() {
		return bad("gateway %q is not a host address of %s", o.Gateway, o.CIDR)
	}
	if s.mtu, err = overlayMTU(o.Network, o.MTU, u); err != nil {
		return overlayShape{}, err
	}
	if s.fence, err = ParseAllow(o.Allow); err != nil {
		return bad("%v", err)
	}
	ipv4 := func(what, v string) (netip.Addr, error) {
		a, err := netip.ParseAddr(v)
		if err != nil || !a.Is4() || a.IsUnspecified() || a.IsMulticast() || a.IsLoopback() {
			return netip.Addr{}, fmt.Errorf("%s %q is not a unicast IPv4 address", what, v)
		}
		return a, nil
	}
	for i, p := range o.Peers {
		a, err := ipv4(fmt.Sprintf("peers[%d] (host %s) underlay_address", i, p.Host), p.Underlay)
		if err != nil {
			return bad("%v", err)
		}
		if a == u.Addr {
			return bad("peers[%d] (host %s) has this host's own underlay address %s", i, p.Host, a)
		}
		if !slices.Contains(s.peers, a) {
			s.peers = append(s.peers, a)
		}
	}
	for i, e := range o.Entries {
		at := fmt.Sprintf("entries[%d]", i)
		mac, err := net.ParseMAC(e.MAC)
		if err != nil || len(mac) != 6 || mac[0]&1 == 1 || bytes.Equal(mac, make([]byte, 6)) {
			return bad("%s: mac_address %q is not a unicast 6-byte MAC address", at, e.MAC)
		}
		dst, err := ipv4(at+": underlay_address", e.Underlay)
		if err != nil {
			return bad("%v", err)
		}
		if dst == u.Addr {
			return bad("%s: underlay_address %s is this host's own: entries are the NICs on other hosts", at, dst)
		}
		ip, err := netip.ParseAddr(e.IPv4)
		if err != nil || !s.cidr.Contains(ip) || ip == s.gw || ip == s.cidr.Addr() {
			return bad("%s: ipv4_address %q is not a guest address of %s", at, e.IPv4, o.CIDR)
		}
		m := mac.String()
		if d, dup := s.fdb[m]; dup && d != dst {
			return bad("%s: mac_address %s is also an entry behind %s", at, m, d)
		}
		if other, dup := s.neigh[ip]; dup && other != m {
			return bad("%s: ipv4_address %s is also the address of %s", at, ip, other)
		}
		s.fdb[m], s.neigh[ip] = dst, m
	}
	return s, nil
}

// PutOverlay makes (or re-adopts) the overlay network on this host: the
// bridge with the gateway address, masquerade and fence as a nat network
// has, the vxlan device on it, the forwarding and neighbour entries equal
// to o's Entries and the UDP 4789 allow list equal to o's Peers. It
// returns the network as the kernel then has it.
func (h *Host) PutOverlay(o agentapi.Overlay) (agentapi.OverlayState, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.underlay.Addr.IsValid() {
		return agentapi.OverlayState{}, fmt.Errorf("network %s: %w", o.Network, ErrNoUnderlay)
	}
	s, err := checkOverlay(o, h.underlay)
	if err != nil {
		return agentapi.OverlayState{}, err
	}
	br := BridgeName(s.network)
	if l, err := netlink.LinkByName(VXLANName(s.network)); err == nil {
		if vx, ok := l.(*netlink.Vxlan); ok && vx.VxlanId != s.vni {
			// The network's VNI changed: its allow list matched the old one.
			if err := deleteOverlayFence(-1, s.network); err != nil {
				return agentapi.OverlayState{}, fmt.Errorf("network %s: %w", s.network, err)
			}
		}
	}
	if err := ensureGatewayBridge(s.network, s.cidr, s.gw, s.fence, s.mtu); err != nil {
		return agentapi.OverlayState{}, err
	}
	vx, err := ensureVXLAN(s.network, s.vni, s.mtu, h.underlay, br)
	if err != nil {
		return agentapi.OverlayState{}, err
	}
	if err := syncFDB(vx, s.fdb); err != nil {
		return agentapi.OverlayState{}, fmt.Errorf("network %s: %w", s.network, err)
	}
	if err := syncNeigh(vx, s.neigh); err != nil {
		return agentapi.OverlayState{}, fmt.Errorf("network %s: %w", s.network, err)
	}
	if err := ensureOverlayFence(-1, s.network, s.vni, s.peers); err != nil {
		return agentapi.OverlayState{}, fmt.Errorf("network %s: %w", s.network, err)
	}
	return readOverlay(vx)
}

// DeleteOverlay removes the overlay network's vxlan device (and with it its
// entries) and allow list, and its bridge, masquerade and fence when no
// guest's port is left on the bridge. Nothing there is not an error.
func (h *Host) DeleteOverlay(network string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return errors.Join(deleteLink(VXLANName(network)), deleteOverlayFence(-1, network), h.dropUnusedBridge(network))
}

// ListOverlays reads every overlay network of this host from the kernel
// (its vxlan devices), sorted by network.
func (h *Host) ListOverlays() ([]agentapi.OverlayState, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	out := []agentapi.OverlayState{}
	for _, l := range links {
		if !strings.HasPrefix(l.Attrs().Name, VXLANPrefix) {
			continue
		}
		st, err := readOverlay(l)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Network < out[j].Network })
	return out, nil
}

// ensureGatewayBridge makes (or re-adopts) the bridge of a nat or overlay
// network with its gateway address, forwarding, masquerade and network
// fence; mtu > 0 sets the bridge's MTU.
func ensureGatewayBridge(network string, cidr netip.Prefix, gw netip.Addr, fence Fence, mtu int) error {
	br := BridgeName(network)
	// A new bridge only: the VMs of a bridge already up keep their
	// network when the host's routes change under them (a new VM is
	// checked in the driver's CheckSpec).
	if exists, err := BridgeExists(br); err != nil || !exists {
		if err := CheckHostRoutes(network, cidr); err != nil {
			return err
		}
	}
	if err := ensureBridge(br, bridgeMAC(network), netip.PrefixFrom(gw, cidr.Bits())); err != nil {
		return err
	}
	if mtu > 0 {
		if err := ensureMTU(br, mtu); err != nil {
			return err
		}
	}
	if err := writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
		return err
	}
	if err := ensureRule(-1, postrouting, masqTag(network), masquerade(cidr)); err != nil {
		return err
	}
	if err := ensureNetworkFence(-1, network, fence); err != nil {
		return fmt.Errorf("network %s: %w", network, err)
	}
	return nil
}

// ensureMTU sets the MTU of the link name unless it has it.
func ensureMTU(name string, mtu int) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("look up %s: %w", name, err)
	}
	if l.Attrs().MTU == mtu {
		return nil
	}
	if err := netlink.LinkSetMTU(l, mtu); err != nil {
		return fmt.Errorf("mtu %d on %s: %w", mtu, name, err)
	}
	return nil
}

// ensureVXLAN makes (or re-adopts) the network's vxlan device on bridge:
// its VNI, local address u, port 4789, no learning, ARP proxy, mtu, up. A
// device made otherwise (another VNI or underlay address) is made again.
func ensureVXLAN(network string, vni, mtu int, u Underlay, bridge string) (netlink.Link, error) {
	name := VXLANName(network)
	want := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: name, MTU: mtu},
		VxlanId:   vni, SrcAddr: u.Addr.AsSlice(), Port: agentapi.OverlayPort, Learning: false, Proxy: true,
	}
	l, err := netlink.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if err == nil {
		if vx, ok := l.(*netlink.Vxlan); !ok || vx.VxlanId != vni || !vx.SrcAddr.Equal(want.SrcAddr) ||
			vx.Port != agentapi.OverlayPort || vx.Learning || !vx.Proxy {
			if err := netlink.LinkDel(l); err != nil {
				return nil, fmt.Errorf("network %s: delete vxlan device %s made otherwise: %w", network, name, err)
			}
			err = netlink.LinkNotFoundError{}
		}
	}
	if errors.As(err, &nf) {
		if err := netlink.LinkAdd(want); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("network %s: create vxlan device %s (vni %d, local %s): %w", network, name, vni, u.Addr, err)
		}
		l, err = netlink.LinkByName(name)
	}
	if err != nil {
		return nil, fmt.Errorf("network %s: look up vxlan device %s: %w", network, name, err)
	}
	if l.Attrs().Alias != overlayAliasPrefix+network {
		if err := netlink.LinkSetAlias(l, overlayAliasPrefix+network); err != nil {
			return nil, fmt.Errorf("network %s: name vxlan device %s: %w", network, name, err)
		}
	}
	if err := ensureMTU(name, mtu); err != nil {
		return nil, fmt.Errorf("network %s: %w", network, err)
	}
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return nil, fmt.Errorf("network %s: look up bridge %s: %w", network, bridge, err)
	}
	if l.Attrs().MasterIndex != br.Attrs().Index {
		if err := netlink.LinkSetMaster(l, br); err != nil {
			return nil, fmt.Errorf("network %s: put vxlan device %s on bridge %s: %w", network, name, bridge, err)
		}
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return nil, fmt.Errorf("network %s: bring vxlan device %s up: %w", network, name, err)
	}
	return netlink.LinkByName(name)
}

// fdbEntries are the vxlan device's own permanent forwarding entries
// (those with a tunnel destination), mac -> destinations.
func fdbEntries(vx netlink.Link) (map[string][]netip.Addr, error) {
	list, err := netlink.NeighList(vx.Attrs().Index, unix.AF_BRIDGE)
	if err != nil {
		return nil, fmt.Errorf("list forwarding entries of %s: %w", vx.Attrs().Name, err)
	}
	out := map[string][]netip.Addr{}
	for _, n := range list {
		dst, ok := netip.AddrFromSlice(n.IP)
		if !ok || n.State&netlink.NUD_PERMANENT == 0 || n.HardwareAddr == nil {
			continue
		}
		out[n.HardwareAddr.String()] = append(out[n.HardwareAddr.String()], dst.Unmap())
	}
	return out, nil
}

func fdbNeigh(vx netlink.Link, mac string, dst netip.Addr) *netlink.Neigh {
	hw, _ := net.ParseMAC(mac)
	return &netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_SELF,
		State: netlink.NUD_PERMANENT, HardwareAddr: hw, IP: dst.AsSlice()}
}

// syncFDB makes the device's forwarding entries exactly want: extra ones
// (an all-zeros one too) go first, then the missing ones are added.
func syncFDB(vx netlink.Link, want map[string]netip.Addr) error {
	have, err := fdbEntries(vx)
	if err != nil {
		return err
	}
	for mac, dsts := range have {
		for _, d := range dsts {
			if w, ok := want[mac]; ok && w == d && len(dsts) == 1 {
				continue
			}
			if err := netlink.NeighDel(fdbNeigh(vx, mac, d)); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("delete forwarding entry %s dst %s of %s: %w", mac, d, vx.Attrs().Name, err)
			}
		}
	}
	for mac, dst := range want {
		if d := have[mac]; len(d) == 1 && d[0] == dst {
			continue
		}
		if err := netlink.NeighAppend(fdbNeigh(vx, mac, dst)); err != nil {
			return fmt.Errorf("add forwarding entry %s dst %s to %s: %w", mac, dst, vx.Attrs().Name, err)
		}
	}
	return nil
}

// neighEntries are the device's permanent IPv4 neighbour entries.
func neighEntries(vx netlink.Link) (map[netip.Addr]string, error) {
	list, err := netlink.NeighList(vx.Attrs().Index, unix.AF_INET)
	if err != nil {
		return nil, fmt.Errorf("list neighbour entries of %s: %w", vx.Attrs().Name, err)
	}
	out := map[netip.Addr]string{}
	for _, n := range list {
		ip, ok := netip.AddrFromSlice(n.IP)
		if !ok || n.State&netlink.NUD_PERMANENT == 0 {
			continue
		}
		out[ip.Unmap()] = n.HardwareAddr.String()
	}
	return out, nil
}

// syncNeigh makes the device's permanent neighbour entries exactly want.
func syncNeigh(vx netlink.Link, want map[netip.Addr]string) error {
	have, err := neighEntries(vx)
	if err != nil {
		return err
	}
	for ip, mac := range have {
		if want[ip] == mac {
			continue
		}
		n := &netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_INET, IP: ip.AsSlice()}
		if err := netlink.NeighDel(n); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("delete neighbour entry %s of %s: %w", ip, vx.Attrs().Name, err)
		}
	}
	for ip, mac := range want {
		if have[ip] == mac {
			continue
		}
		hw, _ := net.ParseMAC(mac)
		n := &netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
			IP: ip.AsSlice(), HardwareAddr: hw}
		if err := netlink.NeighSet(n); err != nil {
			return fmt.Errorf("neighbour entry %s at %s on %s: %w", ip, mac, vx.Attrs().Name, err)
		}
	}
	return nil
}

// readOverlay reads one vxlan device of the agent back from the kernel.
func readOverlay(l netlink.Link) (agentapi.OverlayState, error) {
	name := l.Attrs().Name
	vx, ok := l.(*netlink.Vxlan)
	if !ok {
		return agentapi.OverlayState{}, fmt.Errorf("%s is a %s device, not vxlan", name, l.Type())
	}
	st := agentapi.OverlayState{Network: strings.TrimPrefix(l.Attrs().Alias, overlayAliasPrefix), VNI: vx.VxlanId,
		Device: name, MTU: l.Attrs().MTU, FDB: []agentapi.OverlayFDB{}, Neigh: []agentapi.OverlayNeigh{}}
	if m := l.Attrs().MasterIndex; m > 0 {
		br, err := netlink.LinkByIndex(m)
		if err != nil {
			return agentapi.OverlayState{}, fmt.Errorf("look up the bridge of %s: %w", name, err)
		}
		st.Bridge = br.Attrs().Name
	}
	fdb, err := fdbEntries(l)
	if err != nil {
		return agentapi.OverlayState{}, err
	}
	for mac, dsts := range fdb {
		for _, d := range dsts {
			st.FDB = append(st.FDB, agentapi.OverlayFDB{MAC: mac, Dst: d.String()})
		}
	}
	sort.Slice(st.FDB, func(i, j int) bool {
		if st.FDB[i].MAC != st.FDB[j].MAC {
			return st.FDB[i].MAC < st.FDB[j].MAC
		}
		return st.FDB[i].Dst < st.FDB[j].Dst
	})
	neigh, err := neighEntries(l)
	if err != nil {
		return agentapi.OverlayState{}, err
	}
	for ip, mac := range neigh {
		st.Neigh = append(st.Neigh, agentapi.OverlayNeigh{IPv4: ip.String(), MAC: mac})
	}
	sort.Slice(st.Neigh, func(i, j int) bool {
		a, _ := netip.ParseAddr(st.Neigh[i].IPv4)
		b, _ := netip.ParseAddr(st.Neigh[j].IPv4)
		return a.Less(b)
	})
	return st, nil
}

// The underlay fence: UDP 4789 carrying a network's VNI enters the host
// only from the underlay addresses of that network's peers (inet kvmd,
// input): a jump per network, tagged "overlay <network>", to a chain of
// its own with an accept per peer and a counted drop of the rest. A VNI
// no network has meets no device and the kernel drops it.

func overlayTag(network string) string { return "overlay " + network }

// vxlanVNI: udp dport 4789 and the VXLAN header's VNI (bytes 4..6 of the
// header, after the 8 bytes of UDP) == vni.
func vxlanVNI(vni int) []expr.Any {
	return cat(udpPort(2, agentapi.OverlayPort),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 12, Len: 3},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint32(uint32(vni))[1:]})
}

// ensureOverlayFence makes (or rewrites) the network's allow list of
// peers and the jump to it.
func ensureOverlayFence(nsfd int, network string, vni int, peers []netip.Addr) error {
	var rules []taggedRule
	for _, p := range peers {
		rules = append(rules, taggedRule{"peer " + p.String(),
			cat(match(offSaddr, netip.PrefixFrom(p, 32), expr.CmpOpEq), verdict(expr.VerdictAccept))})
	}
	rules = append(rules, taggedRule{"deny non-peer", drop()})
	name := networkChainName("ovl-", network)
	if err := rebuildChain(nsfd, fenceTable, inputChain, name, rules); err != nil {
		return err
	}
	return ensureJump(nsfd, fenceTable, inputChain, overlayTag(network), cat(ipv4(), vxlanVNI(vni), jump(name)))
}

// deleteOverlayFence removes the network's allow list and jump.
func deleteOverlayFence(nsfd int, network string) error {
	return deleteJumped(nsfd, fenceTable, overlayTag(network), map[*nftables.Chain]string{
		inputChain: networkChainName("ovl-", network),
	})
}
