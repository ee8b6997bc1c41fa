package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"

	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// attachChild makes the namespace of a forked child's NIC (see the package
// comment): the veth pair from the bridge into the namespace, the tap
// there, the routes, proxy ARP and NAT between the child's own address and
// its guest's, and the guest's lease on the tap.
func (h *Host) attachChild(at Attachment, bridge string, cidr netip.Prefix, gw netip.Addr) (Attached, error) {
	nsName := NetNSName(at.Key)
	tap := TapName(at.Key, at.Index)
	own, err := netip.ParseAddr(at.NIC.IPv4Address)
	if err != nil {
		return Attached{}, fmt.Errorf("child %s nic %d: address %q: %w", at.VMID, at.Index, at.NIC.IPv4Address, err)
	}
	guest, err := netip.ParseAddr(at.Guest.IPv4Address)
	if err != nil {
		return Attached{}, fmt.Errorf("child %s nic %d: guest address %q: %w", at.VMID, at.Index, at.Guest.IPv4Address, err)
	}
	ownMAC, err := net.ParseMAC(at.NIC.MACAddress)
	if err != nil {
		return Attached{}, fmt.Errorf("child %s nic %d: mac %q: %w", at.VMID, at.Index, at.NIC.MACAddress, err)
	}
	ns, err := ensureNamedNetNS(nsName)
	if err != nil {
		return Attached{}, err
	}
	defer func() { _ = ns.Close() }()
	fail := func(err error) (Attached, error) {
		return Attached{}, fmt.Errorf("namespace %s of child %s nic %d: %w", nsName, at.VMID, at.Index, err)
	}
	veth, peer := vethName(at.Key, at.Index), peerName(at.Key, at.Index)
	// The veth carries the child's own MAC and address, whatever its
	// guest sends into the namespace.
	port, err := portOf(at, veth, at.NIC)
	if err != nil {
		return fail(err)
	}
	if err := ensurePortFence(-1, port); err != nil {
		return fail(err)
	}
	if err := ensureVeth(veth, peer, bridge, ownMAC, ns); err != nil {
		return fail(err)
	}
	err = inNetNS(int(ns), func() error {
		nh, err := netlink.NewHandle()
		if err != nil {
			return err
		}
		defer nh.Close()
		if lo, err := nh.LinkByName("lo"); err == nil {
			_ = nh.LinkSetUp(lo)
		}
		p, err := nh.LinkByName(peer)
		if err != nil {
			return fmt.Errorf("look up %s: %w", peer, err)
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: own.AsSlice(), Mask: net.CIDRMask(cidr.Bits(), 32)}}
		if err := nh.AddrReplace(p, addr); err != nil {
			return fmt.Errorf("address %s on %s: %w", own, peer, err)
		}
		if err := nh.LinkSetUp(p); err != nil {
			return fmt.Errorf("bring %s up: %w", peer, err)
		}
		// Beyond the network, through the gateway as any guest of it.
		def := &netlink.Route{LinkIndex: p.Attrs().Index, Gw: gw.AsSlice()}
		if err := nh.RouteReplace(def); err != nil {
			return fmt.Errorf("default route via %s on %s: %w", gw, peer, err)
		}
		// The tap wears the gateway's MAC: the guest's ARP cache says so.
		if err := ensureTap(tap, "", bridgeMAC(at.NIC.Network)); err != nil {
			return err
		}
		t, err := nh.LinkByName(tap)
		if err != nil {
			return fmt.Errorf("look up %s: %w", tap, err)
		}
		route := &netlink.Route{LinkIndex: t.Attrs().Index, Scope: netlink.SCOPE_LINK,
			Dst: &net.IPNet{IP: guest.AsSlice(), Mask: net.CIDRMask(32, 32)}}
		if err := nh.RouteReplace(route); err != nil {
			return fmt.Errorf("route %s via %s: %w", guest, tap, err)
		}
		// Any other address of the network (the gateway, other guests)
		// is answered by the namespace and routed out through the veth.
		for _, kv := range [][2]string{{"net/ipv4/ip_forward", "1"}, {"net/ipv4/conf/" + tap + "/proxy_arp", "1"}} {
			if err := writeSysctl(kv[0], kv[1]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fail(err)
	}
	if err := ensureRule(int(ns), prerouting, fmt.Sprintf("dnat %s %s", own, guest),
		natTo(offDaddr, own, guest, expr.NATTypeDestNAT)); err != nil {
		return fail(err)
	}
	if err := ensureRule(int(ns), postrouting, fmt.Sprintf("snat %s %s", guest, own),
		natTo(offSaddr, guest, own, expr.NATTypeSourceNAT)); err != nil {
		return fail(err)
	}
	l, err := leaseOf(at, nsName, tap)
	if err != nil {
		return fail(err)
	}
	l.Router = gw
	if err := h.serve(l, int(ns)); err != nil {
		return fail(err)
	}
	return Attached{Tap: tap, NetNS: nsName}, nil
}

// ensureNamedNetNS opens the named namespace, creating it when missing.
func ensureNamedNetNS(name string) (netns.NsHandle, error) {
	if _, err := os.Stat(filepath.Join(netnsDir, name)); err == nil {
		return netns.GetFromName(name)
	}
	// NewNamed moves the calling thread into the new namespace: on a
	// locked thread that goes back after.
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return netns.None(), err
	}
	defer func() { _ = orig.Close() }()
	ns, err := netns.NewNamed(name)
	if rerr := netns.Set(orig); rerr != nil {
		if ns.IsOpen() {
			_ = ns.Close()
		}
		return netns.None(), errors.Join(err, fmt.Errorf("return to the agent's network namespace: %w", rerr))
	}
	runtime.UnlockOSThread()
	if err != nil {
		return netns.None(), fmt.Errorf("create network namespace %s: %w", name, err)
	}
	return ns, nil
}

// ensureVeth makes the veth pair: veth on bridge in the agent's namespace,
// peer (with mac) in ns.
func ensureVeth(veth, peer, bridge string, mac net.HardwareAddr, ns netns.NsHandle) error {
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return fmt.Errorf("look up bridge %s: %w", bridge, err)
	}
	l, err := netlink.LinkByName(veth)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: veth, MasterIndex: br.Attrs().Index},
			PeerName: peer, PeerHardwareAddr: mac, PeerNamespace: netlink.NsFd(int(ns))}
		if err := netlink.LinkAdd(v); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create veth %s/%s: %w", veth, peer, err)
		}
		l, err = netlink.LinkByName(veth)
	}
	if err != nil {
		return fmt.Errorf("look up veth %s: %w", veth, err)
	}
	if l.Attrs().MasterIndex != br.Attrs().Index {
		if err := netlink.LinkSetMaster(l, br); err != nil {
			return fmt.Errorf("attach veth %s to bridge %s: %w", veth, bridge, err)
		}
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("bring veth %s up: %w", veth, err)
	}
	return nil
}
