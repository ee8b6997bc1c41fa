// Package network is the host side of VM networking for the QEMU driver:
// Linux bridges and taps (made with netlink, github.com/vishvananda/netlink),
// static DHCP leases served on each tap, NAT rules (nftables), and the
// per-child network namespaces of forked guests.
//
// Names are derived, so that a new agent finds what an earlier one made and
// re-adopts it (never tears it down):
//
//	kvb-<hash of network>    the bridge of a nat or overlay network, with the gateway address
//	kvx-<hash of network>    the vxlan device of an overlay network, on its bridge (overlay.go)
//	kvt-<hash of vm, nic>    a VM's tap (vm: its directory, unique on the host)
//	kvv-<hash of vm, nic>    a forked child's veth on the bridge (its peer, kvp-..., is in the child's namespace)
//	kvmd-<hash of vm>        a forked child's named network namespace (/run/netns)
//
// Forks: a child's guest keeps its source's view of its NIC (MAC, address,
// gateway), so putting it on the bridge as is would clash with its source.
// Each child NIC instead gets a namespace of its own (the scheme Firecracker
// documents for snapshot clones): the tap is there, with the gateway's MAC
// and proxy ARP, a route to the guest's address, and a veth whose inside end
// has the child's own address and MAC on the bridge. NAT in the namespace
// maps the child's address to the guest's (DNAT in, SNAT out). QEMU runs in
// that namespace. The child is reached at its own address; the source keeps
// its own.
package network

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// Name prefixes of what the agent makes.
const (
	BridgePrefix = "kvb-"
	TapPrefix    = "kvt-"
	VethPrefix   = "kvv-"
	PeerPrefix   = "kvp-"
	NetNSPrefix  = "kvmd-"
)

func hash(parts ...string) string {
	h := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(h[:])
}

// BridgeName is the bridge of a nat network (15 bytes at most).
func BridgeName(network string) string { return BridgePrefix + hash("bridge", network)[:11] }

// TapName is the tap of NIC index of a VM.
func TapName(vmID string, index int) string {
	return TapPrefix + hash("tap", vmID, fmt.Sprint(index))[:11]
}

func vethName(vmID string, index int) string {
	return VethPrefix + hash("veth", vmID, fmt.Sprint(index))[:11]
}
func peerName(vmID string, index int) string {
	return PeerPrefix + hash("veth", vmID, fmt.Sprint(index))[:11]
}

// NetNSName is the namespace of a forked child (all its nat NICs).
func NetNSName(vmID string) string { return NetNSPrefix + hash("netns", vmID)[:16] }

// bridgeMAC is the bridge's MAC, fixed by the network's name: a child's tap
// wears it too, so that frames its guest addresses to the gateway it knew
// are the tap's.
func bridgeMAC(network string) net.HardwareAddr {
	h := hash("mac", network)
	b, _ := hex.DecodeString(h[:12])
	b[0] = b[0]&0xfe | 0x02 // unicast, locally administered
	return b
}

// Host makes and removes the host side of NICs. Its methods are safe for
// concurrent use (one at a time: a bridge is shared by the VMs of a network).
type Host struct {
	log *slog.Logger

	mu         sync.Mutex
	responders map[string]*responder // by namespace + "/" + tap
	// underlay is where overlay networks' VXLAN tunnels start (overlay.go).
	underlay Underlay
}

// New returns a Host.
func New(log *slog.Logger) *Host {
	if log == nil {
		log = slog.Default()
	}
	return &Host{log: log, responders: map[string]*responder{}}
}

// Attachment is one NIC to attach.
type Attachment struct {
	VMID string
	// Key names the VM on this host in the names of its taps, veths and
	// namespace: its directory, unique even across agents on one host.
	Key   string
	Index int
	// NIC is the VM's NIC as the control plane sees it (its own MAC and
	// address). Guest is the NIC as the guest sees it: the same for a VM
	// booted with it, its source's for a child started from a snapshot.
	NIC, Guest agentapi.NIC
	Hostname   string // sent with the DHCP lease
}

// Forked says whether the NIC needs a namespace of its own: a child whose
// guest holds another MAC or address than the NIC's own.
func (a Attachment) Forked() bool {
	return (a.NIC.Mode == agentapi.NetworkNAT || a.NIC.Mode == agentapi.NetworkOverlay) &&
		(a.Guest.MACAddress != a.NIC.MACAddress || a.Guest.IPv4Address != a.NIC.IPv4Address)
}

// Attached says where QEMU finds the NIC's tap.
type Attached struct {
	Tap   string
	NetNS string // the named namespace QEMU must run in ("" for the agent's own)
}

// BridgeExists says whether an interface name exists and is a bridge.
func BridgeExists(name string) (bool, error) {
	l, err := netlink.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up bridge %s: %w", name, err)
	}
	return l.Type() == "bridge", nil
}

// Attach makes (or re-adopts) the host side of one nat or bridge NIC:
// the bridge, the tap on it, the DHCP lease, the NAT rules, the fence
// (filter.go) of the network and of the port. It is
// idempotent; what exists is kept as it is.
func (h *Host) Attach(at Attachment) (Attached, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := at.NIC
	tap := TapName(at.Key, at.Index)
	var master string
	switch n.Mode {
	case agentapi.NetworkNAT, agentapi.NetworkOverlay:
		cidr, gw, err := natShape(n)
		if err != nil {
			return Attached{}, err
		}
		master = BridgeName(n.Network)
		fence, err := ParseAllow(n.Allow)
		if err != nil {
			return Attached{}, fmt.Errorf("network %s: %w", n.Network, err)
		}
		mtu := n.MTU
		if n.Mode == agentapi.NetworkOverlay {
			if !h.underlay.Addr.IsValid() {
				return Attached{}, fmt.Errorf("nic %d of vm %s: overlay network %s: %w: start the agent with --underlay-address",
					at.Index, at.VMID, n.Network, ErrNoUnderlay)
			}
			if mtu, err = overlayMTU(n.Network, n.MTU, h.underlay); err != nil {
				return Attached{}, err
			}
		}
		if err := ensureGatewayBridge(n.Network, cidr, gw, fence, mtu); err != nil {
			return Attached{}, err
		}
		if n.Mode == agentapi.NetworkOverlay {
			// The entries come with PutOverlay; the device is here from
			// the first NIC on.
			if _, err := ensureVXLAN(n.Network, n.VNI, mtu, h.underlay, master); err != nil {
				return Attached{}, err
			}
		}
		if at.Forked() {
			return h.attachChild(at, master, cidr, gw)
		}
	case agentapi.NetworkBridge:
		master = n.Bridge
		ok, err := BridgeExists(master)
		if err != nil {
			return Attached{}, err
		}
		if !ok {
			host, _ := os.Hostname()
			return Attached{}, fmt.Errorf("bridge %s does not exist on host %s", master, host)
		}
	default:
		return Attached{}, fmt.Errorf("nic %d of vm %s: mode %s has no host side", at.Index, at.VMID, n.Mode)
	}
	port, err := portOf(at, tap, n)
	if err != nil {
		return Attached{}, err
	}
	// Before the tap is on the bridge: no frame passes unchecked.
	if err := ensurePortFence(-1, port); err != nil {
		return Attached{}, fmt.Errorf("nic %d of vm %s: %w", at.Index, at.VMID, err)
	}
	if err := ensureTap(tap, master, nil); err != nil {
		return Attached{}, err
	}
	if mtu := nicMTU(n); mtu > 0 {
		if err := ensureMTU(tap, mtu); err != nil {
			return Attached{}, fmt.Errorf("nic %d of vm %s: %w", at.Index, at.VMID, err)
		}
	}
	if n.IPv4Address != "" && (n.Mode == agentapi.NetworkNAT || n.Mode == agentapi.NetworkOverlay || n.DHCP) {
		l, err := leaseOf(at, "", tap)
		if err != nil {
			return Attached{}, err
		}
		if err := h.serve(l, -1); err != nil {
			return Attached{}, err
		}
	}
	return Attached{Tap: tap}, nil
}

// portOf is what the port name of NIC n (its tap, or a child's veth) may
// carry: n's MAC, and n's address when the control plane assigned one.
func portOf(at Attachment, name string, n agentapi.NIC) (Port, error) {
	mac, err := net.ParseMAC(n.MACAddress)
	if err != nil {
		return Port{}, fmt.Errorf("nic %d of vm %s: mac %q: %w", at.Index, at.VMID, n.MACAddress, err)
	}
	p := Port{Name: name, MAC: mac, IPv6: n.Mode == agentapi.NetworkBridge}
	if n.IPv4Address != "" {
		if p.IPv4, err = netip.ParseAddr(n.IPv4Address); err != nil || !p.IPv4.Is4() {
			return Port{}, fmt.Errorf("nic %d of vm %s: address %q is not an IPv4 address", at.Index, at.VMID, n.IPv4Address)
		}
	}
	return p, nil
}

// nicMTU is the MTU of n's network on the host and in the guest: its own,
// the overlay default for an overlay, else 0 (the link's default).
func nicMTU(n agentapi.NIC) int {
	if n.MTU == 0 && n.Mode == agentapi.NetworkOverlay {
		return agentapi.OverlayMTUDefault
	}
	return n.MTU
}

func natShape(n agentapi.NIC) (netip.Prefix, netip.Addr, error) {
	cidr, err := netip.ParsePrefix(n.CIDR)
	if err != nil {
		return cidr, netip.Addr{}, fmt.Errorf("network %s: cidr %q: %w", n.Network, n.CIDR, err)
	}
	gw, err := netip.ParseAddr(n.Gateway)
	if err != nil {
		return cidr, gw, fmt.Errorf("network %s: gateway %q: %w", n.Network, n.Gateway, err)
	}
	return cidr, gw, nil
}

func leaseOf(at Attachment, ns, tap string) (Lease, error) {
	g := at.Guest
	cidr, err := netip.ParsePrefix(g.CIDR)
	if err != nil {
		return Lease{}, fmt.Errorf("nic %d of vm %s: cidr %q: %w", at.Index, at.VMID, g.CIDR, err)
	}
	addr, err := netip.ParseAddr(g.IPv4Address)
	if err != nil {
		return Lease{}, fmt.Errorf("nic %d of vm %s: address %q: %w", at.Index, at.VMID, g.IPv4Address, err)
	}
	l := Lease{NetNS: ns, Tap: tap, MAC: strings.ToLower(g.MACAddress), Address: netip.PrefixFrom(addr, cidr.Bits()),
		Hostname: at.Hostname, MTU: nicMTU(at.NIC)}
	if g.Gateway != "" {
		if l.Router, err = netip.ParseAddr(g.Gateway); err != nil {
			return Lease{}, fmt.Errorf("nic %d of vm %s: gateway %q: %w", at.Index, at.VMID, g.Gateway, err)
		}
	}
	return l, nil
}

// serve starts the responder of l unless it runs already.
func (h *Host) serve(l Lease, nsfd int) error {
	key := l.NetNS + "/" + l.Tap
	if r, ok := h.responders[key]; ok {
		if r.lease == l {
			return nil
		}
		r.stop()
		delete(h.responders, key)
	}
	var r *responder
	err := inNetNS(nsfd, func() error {
		var err error
		r, err = startResponder(h.log, l)
		return err
	})
	if err != nil {
		return err
	}
	h.responders[key] = r
	return nil
}

// Leases lists the leases being served, sorted by tap.
func (h *Host) Leases() []Lease {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Lease, 0, len(h.responders))
	for _, r := range h.responders {
		out = append(out, r.lease)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].NetNS+out[i].Tap < out[j].NetNS+out[j].Tap })
	return out
}

// Close stops the DHCP responders; taps, bridges and rules stay for the
// next agent (running guests keep their addresses).
func (h *Host) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, r := range h.responders {
		r.stop()
		delete(h.responders, k)
	}
}

// Detach removes the host side of one NIC: its lease, its tap (or its
// namespace and veth) and its port's fence, and the network's bridge,
// masquerade rule and fence when no other NIC is on it. Nothing there is not an error.
func (h *Host) Detach(key string, index int, n agentapi.NIC) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	tap := TapName(key, index)
	ns := NetNSName(key)
	var errs []error
	for _, key := range []string{"/" + tap, ns + "/" + tap} {
		if r, ok := h.responders[key]; ok {
			r.stop()
			delete(h.responders, key)
		}
	}
	errs = append(errs, deleteLink(tap), deleteLink(vethName(key, index)),
		deletePortFence(-1, tap), deletePortFence(-1, vethName(key, index)))
	if _, err := os.Stat(filepath.Join(netnsDir, ns)); err == nil {
		if err := netns.DeleteNamed(ns); err != nil {
			errs = append(errs, fmt.Errorf("delete network namespace %s: %w", ns, err))
		}
	}
	if n.Mode == agentapi.NetworkNAT || n.Mode == agentapi.NetworkOverlay {
		errs = append(errs, h.dropUnusedBridge(n.Network))
	}
	return errors.Join(errs...)
}

// dropUnusedBridge deletes a nat or overlay network's bridge, masquerade
// rule and fence once no guest's port is left on the bridge, and with them
// an overlay's vxlan device (entries and all) and its allow list.
func (h *Host) dropUnusedBridge(network string) error {
	br := BridgeName(network)
	l, err := netlink.LinkByName(br)
	var nf netlink.LinkNotFoundError
	dropRest := func() error {
		return errors.Join(deleteLink(VXLANName(network)), deleteOverlayFence(-1, network),
			deleteRule(-1, postrouting, masqTag(network)), deleteNetworkFence(-1, network))
	}
	if errors.As(err, &nf) {
		return dropRest()
	}
	if err != nil {
		return fmt.Errorf("look up bridge %s: %w", br, err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	for _, p := range links {
		if p.Attrs().MasterIndex == l.Attrs().Index && !strings.HasPrefix(p.Attrs().Name, VXLANPrefix) {
			return nil // still in use
		}
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("delete bridge %s of network %s: %w", br, network, err)
	}
	return dropRest()
}

func deleteLink(name string) error {
	l, err := netlink.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up %s: %w", name, err)
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("delete %s: %w", name, err)
	}
	return nil
}

// CheckHostRoutes refuses a nat network whose CIDR overlaps a route of
// this host that the agent did not make (any table, the local one with the
// host's own and loopback addresses too; the default route claims no
// range, and routes on the agent's own bridges are its networks'): the
// gateway address on the bridge would take over that range, e.g. the
// host's LAN or a metadata service, for the guests and the host alike.
func CheckHostRoutes(network string, cidr netip.Prefix) error {
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return fmt.Errorf("network %s: list the host's routes: %w", network, err)
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		dst, ok := netip.AddrFromSlice(r.Dst.IP)
		if !ok || ones == 0 {
			continue
		}
		dstPrefix := netip.PrefixFrom(dst.Unmap(), ones)
		if !dstPrefix.Overlaps(cidr) {
			continue
		}
		dev := "no device"
		if r.LinkIndex > 0 {
			l, err := netlink.LinkByIndex(r.LinkIndex)
			if err != nil {
				return fmt.Errorf("network %s: look up the device of route %s: %w", network, dstPrefix, err)
			}
			if strings.HasPrefix(l.Attrs().Name, BridgePrefix) {
				continue
			}
			dev = "dev " + l.Attrs().Name
		}
		return fmt.Errorf("network %s: cidr %s overlaps the route %s %s (table %d) of this host, which kvmd did not make: "+
			"the gateway address would take that range over; give the network a cidr no host route covers", network, cidr, dstPrefix, dev, r.Table)
	}
	return nil
}

// ensureBridge makes the bridge with mac and address gw (a prefix), up; an
// existing one gets what it lacks.
func ensureBridge(name string, mac net.HardwareAddr, gw netip.Prefix) error {
	l, err := netlink.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, HardwareAddr: mac}}
		if err := netlink.LinkAdd(br); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create bridge %s: %w", name, err)
		}
		l, err = netlink.LinkByName(name)
	}
	if err != nil {
		return fmt.Errorf("look up bridge %s: %w", name, err)
	}
	if l.Attrs().HardwareAddr.String() != mac.String() {
		if err := netlink.LinkSetHardwareAddr(l, mac); err != nil {
			return fmt.Errorf("set mac of bridge %s: %w", name, err)
		}
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: gw.Addr().AsSlice(), Mask: net.CIDRMask(gw.Bits(), 32)}}
	if err := netlink.AddrReplace(l, addr); err != nil {
		return fmt.Errorf("address %s on bridge %s: %w", gw, name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("bring bridge %s up: %w", name, err)
	}
	return nil
}

// ensureTap makes a persistent tap (single queue, as QEMU opens it without
// queues=), on master when given, with mac when given, up, in the
// namespace of the calling thread.
func ensureTap(name, master string, mac net.HardwareAddr) error {
	nh, err := netlink.NewHandle()
	if err != nil {
		return err
	}
	defer nh.Close()
	l, err := nh.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: name}, Mode: netlink.TUNTAP_MODE_TAP,
			Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR}
		if err := nh.LinkAdd(tap); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create tap %s: %w", name, err)
		}
		l, err = nh.LinkByName(name)
	}
	if err != nil {
		return fmt.Errorf("look up tap %s: %w", name, err)
	}
	if mac != nil && l.Attrs().HardwareAddr.String() != mac.String() {
		if err := nh.LinkSetHardwareAddr(l, mac); err != nil {
			return fmt.Errorf("set mac of tap %s: %w", name, err)
		}
	}
	if master != "" {
		br, err := nh.LinkByName(master)
		if err != nil {
			return fmt.Errorf("look up bridge %s for tap %s: %w", master, name, err)
		}
		if l.Attrs().MasterIndex != br.Attrs().Index {
			if err := nh.LinkSetMaster(l, br); err != nil {
				return fmt.Errorf("attach tap %s to bridge %s: %w", name, master, err)
			}
		}
	}
	if err := nh.LinkSetUp(l); err != nil {
		return fmt.Errorf("bring tap %s up: %w", name, err)
	}
	return nil
}

// writeSysctl sets /proc/sys/<key> in the namespace of the calling thread.
func writeSysctl(key, value string) error {
	path := filepath.Join("/proc/sys", key)
	if b, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(b)) == value {
		return nil
	}
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

const netnsDir = "/run/netns"

// inNetNS runs fn on a thread in the namespace nsfd (-1: as is). The
// thread goes back to its namespace after; if it cannot, it is not
// unlocked, so Go ends it instead of reusing it.
func inNetNS(nsfd int, fn func() error) error {
	if nsfd < 0 {
		return fn()
	}
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("current network namespace: %w", err)
	}
	defer func() { _ = orig.Close() }()
	if err := netns.Set(netns.NsHandle(nsfd)); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter network namespace: %w", err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		return errors.Join(ferr, fmt.Errorf("return to the agent's network namespace: %w", err))
	}
	runtime.UnlockOSThread()
	return ferr
}

// RunIn runs fn on a thread in the named namespace ns ("": as is), e.g.
// to start QEMU there: a process started from that thread lives in it.
func RunIn(ns string, fn func() error) error {
	if ns == "" {
		return fn()
	}
	h, err := netns.GetFromName(ns)
	if err != nil {
		return fmt.Errorf("network namespace %s: %w", ns, err)
	}
	defer func() { _ = h.Close() }()
	return inNetNS(int(h), fn)
}
