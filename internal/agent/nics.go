package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// maxNICs bounds the NICs of one VM.
const maxNICs = 8

// NetworkDriver is a Driver whose VMs' NICs have host-side state that
// outlives the VMM process: taps, bridges, DHCP leases, NAT rules, host
// ports. The agent calls AdoptNetwork for every VM it loads at start (the
// state is re-adopted, never torn down, so running guests keep their
// connectivity) and ReleaseNetwork when a VM is deleted (nothing of it is
// left). Boot and Spawn make the state as needed and fill the host ports of
// port forwards into m.NICs.
type NetworkDriver interface {
	AdoptNetwork(ctx context.Context, m *Machine) error
	ReleaseNetwork(ctx context.Context, m *Machine) error
}

var networkNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// ValidInterfaceName says whether name can name a Linux network interface
// (1 to 15 bytes, no '/', ':' or white space, not "." or "..").
func ValidInterfaceName(name string) bool {
	if name == "" || len(name) > 15 || name == "." || name == ".." {
		return false
	}
	return !strings.ContainsAny(name, "/: \t\n\r\v\f")
}

// checkNICs validates the NICs of a spec before anything is created.
func checkNICs(nics []agentapi.NIC) error {
	if len(nics) > maxNICs {
		return errInvalid("a vm has at most %d nics, got %d", maxNICs, len(nics))
	}
	macs := map[string]int{}
	for i, n := range nics {
		at := fmt.Sprintf("nics[%d]", i)
		if !networkNamePattern.MatchString(n.Network) {
			return errInvalid("%s: network %q is not a valid network name (1 to 63 letters, digits, '.', '_' or '-')", at, n.Network)
		}
		at += " (network " + n.Network + ")"
		mac, err := net.ParseMAC(n.MACAddress)
		if err != nil || len(mac) != 6 {
			return errInvalid("%s: mac_address %q is not a 6-byte MAC address like 52:54:00:12:34:56", at, n.MACAddress)
		}
		if mac[0]&1 == 1 {
			return errInvalid("%s: mac_address %s is a multicast address; a NIC needs a unicast one (even first byte)", at, n.MACAddress)
		}
		if j, dup := macs[mac.String()]; dup {
			return errInvalid("%s: mac_address %s is also the MAC of nics[%d]", at, n.MACAddress, j)
		}
		macs[mac.String()] = i
		switch n.Mode {
		case agentapi.NetworkUser:
			if n.Bridge != "" || n.DHCP {
				return errInvalid("%s: mode user takes no bridge and no dhcp (QEMU's user-mode stack serves its own addresses)", at)
			}
		case agentapi.NetworkNAT:
			if n.CIDR == "" || n.Gateway == "" || n.IPv4Address == "" {
				return errInvalid("%s: mode nat needs cidr, gateway and ipv4_address", at)
			}
			if len(n.PortForwards) > 0 {
				return errInvalid("%s: port_forwards are for mode user only; a nat guest is reached at its address", at)
			}
		case agentapi.NetworkOverlay:
			if n.CIDR == "" || n.Gateway == "" || n.IPv4Address == "" {
				return errInvalid("%s: mode overlay needs cidr, gateway and ipv4_address", at)
			}
			if n.VNI < agentapi.OverlayVNIMin || n.VNI > agentapi.OverlayVNIMax {
				return errInvalid("%s: mode overlay needs a vni from %d to %d, got %d", at, agentapi.OverlayVNIMin, agentapi.OverlayVNIMax, n.VNI)
			}
			if len(n.PortForwards) > 0 {
				return errInvalid("%s: port_forwards are for mode user only; an overlay guest is reached at its address", at)
			}
		case agentapi.NetworkBridge:
			if !ValidInterfaceName(n.Bridge) {
				return errInvalid("%s: bridge %q is not a valid interface name (1 to 15 bytes, no '/', ':' or spaces)", at, n.Bridge)
			}
			if len(n.PortForwards) > 0 {
				return errInvalid("%s: port_forwards are for mode user only; a bridged guest is reached at its address", at)
			}
			if n.DHCP && (n.CIDR == "" || n.IPv4Address == "") {
				return errInvalid("%s: dhcp on a bridge needs cidr and ipv4_address", at)
			}
		default:
			return errInvalid("%s: mode %q is not one of user, nat, bridge, overlay", at, n.Mode)
		}
		if n.MTU != 0 && (n.MTU < agentapi.OverlayMTUMin || n.MTU > agentapi.OverlayMTUMax) {
			return errInvalid("%s: mtu %d is not between %d and %d", at, n.MTU, agentapi.OverlayMTUMin, agentapi.OverlayMTUMax)
		}
		if err := checkAddresses(at, n); err != nil {
			return err
		}
		ports := map[int]bool{}
		for _, f := range n.PortForwards {
			if f.GuestPort < 1 || f.GuestPort > 65535 {
				return errInvalid("%s: port_forwards guest_port %d is not between 1 and 65535", at, f.GuestPort)
			}
			if ports[f.GuestPort] {
				return errInvalid("%s: port_forwards: guest_port %d is forwarded twice", at, f.GuestPort)
			}
			ports[f.GuestPort] = true
		}
	}
	return nil
}

// checkAddresses checks a NIC's cidr, gateway and address against each other.
func checkAddresses(at string, n agentapi.NIC) error {
	if n.CIDR == "" {
		if n.Gateway != "" || n.IPv4Address != "" {
			return errInvalid("%s: gateway and ipv4_address need the network's cidr", at)
		}
		return nil
	}
	prefix, err := netip.ParsePrefix(n.CIDR)
	if err != nil || !prefix.Addr().Is4() || prefix != prefix.Masked() || prefix.Bits() > 30 {
		return errInvalid("%s: cidr %q is not an IPv4 network like 10.20.0.0/24 (prefix at most /30, no host bits)", at, n.CIDR)
	}
	if r, what, ok := agentapi.ReservedRange(prefix); ok {
		return errInvalid("%s: cidr %s overlaps %s, %s: no network of guests", at, n.CIDR, r, what)
	}
	inside := func(field, s string) (netip.Addr, error) {
		a, err := netip.ParseAddr(s)
		if err != nil || !a.Is4() {
			return netip.Addr{}, errInvalid("%s: %s %q is not an IPv4 address", at, field, s)
		}
		if !prefix.Contains(a) || a == prefix.Addr() || a == lastAddr(prefix) {
			return netip.Addr{}, errInvalid("%s: %s %s is not a host address of %s", at, field, s, n.CIDR)
		}
		return a, nil
	}
	var gw netip.Addr
	if n.Gateway != "" {
		if gw, err = inside("gateway", n.Gateway); err != nil {
			return err
		}
	}
	if n.IPv4Address != "" {
		a, err := inside("ipv4_address", n.IPv4Address)
		if err != nil {
			return err
		}
		if a == gw {
			return errInvalid("%s: ipv4_address %s is the gateway's address", at, n.IPv4Address)
		}
	}
	return nil
}

// lastAddr is the broadcast address of an IPv4 prefix.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// requestedNICs is a copy of the spec's NICs with what the agent chooses
// (host addresses and ports of forwards) cleared, and MACs in canonical form.
func requestedNICs(nics []agentapi.NIC) []agentapi.NIC {
	if len(nics) == 0 {
		return nil
	}
	out := make([]agentapi.NIC, len(nics))
	for i, n := range nics {
		if mac, err := net.ParseMAC(n.MACAddress); err == nil {
			n.MACAddress = mac.String()
		}
		fw := make([]agentapi.PortForward, len(n.PortForwards))
		for j, f := range n.PortForwards {
			fw[j] = agentapi.PortForward{GuestPort: f.GuestPort}
		}
		if len(fw) == 0 {
			fw = nil
		}
		n.PortForwards = fw
		out[i] = n
	}
	return out
}

// sameNICs says whether a VM's NICs are those a spec asks for (ignoring
// what the agent chose), for an idempotent create.
func sameNICs(have, want []agentapi.NIC) bool {
	return slices.EqualFunc(requestedNICs(have), requestedNICs(want), func(a, b agentapi.NIC) bool {
		return a.Network == b.Network && a.Mode == b.Mode && a.MACAddress == b.MACAddress && a.CIDR == b.CIDR &&
			a.Gateway == b.Gateway && a.DHCP == b.DHCP && a.Bridge == b.Bridge && a.IPv4Address == b.IPv4Address &&
			a.VNI == b.VNI && a.MTU == b.MTU && slices.Equal(a.PortForwards, b.PortForwards)
	})
}

// cloneNICs deep-copies NICs, so that a driver filling host ports never
// writes into a record another goroutine reads.
func cloneNICs(nics []agentapi.NIC) []agentapi.NIC {
	if nics == nil {
		return nil
	}
	out := slices.Clone(nics)
	for i := range out {
		out[i].PortForwards = slices.Clone(out[i].PortForwards)
	}
	return out
}

// adoptNetwork re-adopts the host-side network state of a loaded VM.
func (a *Agent) adoptNetwork(ctx context.Context, r vmRecord) {
	nd, ok := a.cfg.Driver.(NetworkDriver)
	if !ok || len(r.NICs) == 0 {
		return
	}
	if err := nd.AdoptNetwork(ctx, machineOf(a, r)); err != nil {
		a.log.Error("re-adopt the network of a vm; its guest may be unreachable until it is started again", "vm", r.ID, "err", err)
	}
}

// releaseNetwork removes the host-side network state of a VM being deleted.
func (a *Agent) releaseNetwork(ctx context.Context, m *Machine) error {
	nd, ok := a.cfg.Driver.(NetworkDriver)
	if !ok || (len(m.NICs) == 0 && len(m.GuestNICs) == 0) {
		return nil
	}
	if err := nd.ReleaseNetwork(ctx, m); err != nil {
		return fmt.Errorf("release the network of vm %s: %w", m.ID, err)
	}
	return nil
}
