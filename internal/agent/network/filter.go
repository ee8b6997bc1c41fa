package network

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The guest fence: filter rules beside the NAT rules, in two more tables
// named TableName (nftables tables are per family, so these never meet the
// ip table of nft.go nor the operator's tables):
//
//	inet kvmd    forward: a nat network's guests reach their own network,
//	                      the networks and CIDRs the network allows, and
//	                      the outside through NAT; not the agent's other
//	                      networks, not private or special ranges.
//	             input:   a nat network's guests reach nothing of the host
//	                      but its DHCP port (replies to what the host opened
//	                      pass).
//	bridge kvmd  prerouting: each guest's port (tap, or a child's veth)
//	                      carries only its own MAC, its own IPv4 address
//	                      (0.0.0.0 for a DHCP request), ARP that tells the
//	                      truth about both, and no DHCP server traffic.
//
// Each network and each port has a chain of its own, rebuilt whole in one
// transaction on every attach (a new agent re-adopting rewrites it as it
// was: nothing is duplicated), and reached by one tagged jump rule from the
// base chain. A drop counts its packets (nft list table inet kvmd shows
// what was stopped).
var (
	fenceTable = &nftables.Table{Family: nftables.TableFamilyINet, Name: TableName}
	portTable  = &nftables.Table{Family: nftables.TableFamilyBridge, Name: TableName}

	acceptPolicy = nftables.ChainPolicyAccept

	// Policy accept: the base chains judge only the agent's own
	// interfaces; everything else of the host passes as before.
	forwardChain = &nftables.Chain{Name: "forward", Table: fenceTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &acceptPolicy}
	inputChain = &nftables.Chain{Name: "input", Table: fenceTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &acceptPolicy}
	// -200: the bridge family's filter priority.
	portsChain = &nftables.Chain{Name: "prerouting", Table: portTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(-200), Policy: &acceptPolicy}
)

// deniedRanges are the destinations a nat network's guests do not reach
// unless the network allows them: the private ranges (the operator's LAN,
// other clouds' guests), loopback, link-local (metadata services), shared
// and benchmark space, multicast and the reserved rest. The documentation
// ranges stay routable: they reach nothing real, and tests play "outside"
// on them.
var deniedRanges = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// DeniedRanges lists the ranges a nat network's guests do not reach
// unless the network's allow list names them (for docs and tests).
func DeniedRanges() []netip.Prefix { return append([]netip.Prefix(nil), deniedRanges...) }

// FenceRule is one rule of the fence, as listed for tests and operators.
type FenceRule struct {
	Family  string // "inet" or "bridge"
	Chain   string
	Tag     string // what the rule is for, e.g. "deny other networks"
	Packets uint64 // what its counter saw (0 for a rule without one)
}

// ListFence lists the fence's rules in the namespace nsfd (-1: its own).
func ListFence(nsfd int) ([]FenceRule, error) {
	c, err := nftConn(nsfd)
	if err != nil {
		return nil, err
	}
	var out []FenceRule
	for _, t := range []*nftables.Table{fenceTable, portTable} {
		chains, err := c.ListChainsOfTableFamily(t.Family)
		if err != nil {
			return nil, fmt.Errorf("list nftables chains: %w", err)
		}
		fam := "inet"
		if t.Family == nftables.TableFamilyBridge {
			fam = "bridge"
		}
		for _, ch := range chains {
			if ch.Table.Name != TableName {
				continue
			}
			rules, err := c.GetRules(t, ch)
			if err != nil {
				return nil, fmt.Errorf("nftables: list chain %s %s: %w", fam, ch.Name, err)
			}
			for _, r := range rules {
				fr := FenceRule{Family: fam, Chain: ch.Name, Tag: string(r.UserData)}
				for _, e := range r.Exprs {
					if cnt, ok := e.(*expr.Counter); ok {
						fr.Packets = cnt.Packets
					}
				}
				out = append(out, fr)
			}
		}
	}
	return out, nil
}

// Fence is what a nat network's guests may reach beyond their own network
// and the outside: other nat networks by name (their bridge on this host),
// and CIDRs (also the denied ranges).
type Fence struct {
	Networks []string
	CIDRs    []netip.Prefix
}

// ParseAllow splits a network's allow list into names and CIDRs.
func ParseAllow(allow []string) (Fence, error) {
	var f Fence
	for _, a := range allow {
		if strings.Contains(a, "/") {
			p, err := netip.ParsePrefix(a)
			if err != nil || !p.Addr().Is4() {
				return Fence{}, fmt.Errorf("allow entry %q is neither a network name nor an IPv4 CIDR", a)
			}
			f.CIDRs = append(f.CIDRs, p.Masked())
			continue
		}
		f.Networks = append(f.Networks, a)
	}
	return f, nil
}

func networkChainName(prefix, network string) string { return prefix + BridgeName(network) }

func networkTag(network string) string { return "network " + network }

// ensureNetworkFence makes (or rewrites) the forward and input chains of
// the nat network and the jumps to them.
func ensureNetworkFence(nsfd int, network string, f Fence) error {
	br := BridgeName(network)
	fwd := []taggedRule{{"own network", cat(ifname(expr.MetaKeyOIFNAME, br), verdict(expr.VerdictAccept))}}
	for _, other := range f.Networks {
		fwd = append(fwd, taggedRule{"allow network " + other,
			cat(ifname(expr.MetaKeyOIFNAME, BridgeName(other)), verdict(expr.VerdictAccept))})
	}
	for _, p := range f.CIDRs {
		fwd = append(fwd, taggedRule{"allow " + p.String(), cat(ipv4(), match(offDaddr, p, expr.CmpOpEq), verdict(expr.VerdictAccept))})
	}
	fwd = append(fwd, taggedRule{"deny other networks", cat(ifnamePrefix(expr.MetaKeyOIFNAME, BridgePrefix), drop())})
	for _, p := range deniedRanges {
		fwd = append(fwd, taggedRule{"deny " + p.String(), cat(ipv4(), match(offDaddr, p, expr.CmpOpEq), drop())})
	}
	fwd = append(fwd, taggedRule{"deny ipv6", cat(nfproto(unix.NFPROTO_IPV6), drop())})

	in := []taggedRule{
		{"dhcp", cat(udpPort(2, 67), verdict(expr.VerdictAccept))},
		{"deny host", drop()},
	}
	tag := networkTag(network)
	for _, c := range []struct {
		base  *nftables.Chain
		name  string
		rules []taggedRule
	}{
		{forwardChain, networkChainName("fwd-", network), fwd},
		{inputChain, networkChainName("in-", network), in},
	} {
		if err := rebuildChain(nsfd, fenceTable, c.base, c.name, c.rules); err != nil {
			return err
		}
		if err := ensureJump(nsfd, fenceTable, c.base, tag, cat(ifname(expr.MetaKeyIIFNAME, br), jump(c.name))); err != nil {
			return err
		}
	}
	return nil
}

// deleteNetworkFence removes the nat network's chains and jumps, and the
// table once no network is left in it.
func deleteNetworkFence(nsfd int, network string) error {
	tag := networkTag(network)
	return deleteJumped(nsfd, fenceTable, tag, map[*nftables.Chain]string{
		forwardChain: networkChainName("fwd-", network),
		inputChain:   networkChainName("in-", network),
	})
}

// Port is one guest's port on a bridge, with what it may carry.
type Port struct {
	Name string           // the tap, or a child's veth
	MAC  net.HardwareAddr // the guest's
	IPv4 netip.Addr       // invalid: the address is not known (a bridge network without cidr)
	// IPv6 passes (minus router advertisements and DHCPv6 server traffic):
	// an operator's bridge may carry it; a nat network does not route it.
	IPv6 bool
}

func portChainName(port string) string { return "port-" + port }

func portTag(port string) string { return "port " + port }

// ensurePortFence makes (or rewrites) the anti-spoofing chain of a port.
func ensurePortFence(nsfd int, p Port) error {
	if len(p.MAC) != 6 {
		return fmt.Errorf("port %s: mac %q is not an Ethernet address", p.Name, p.MAC)
	}
	rules := []taggedRule{
		{"spoofed mac", cat(etherSaddr(p.MAC, expr.CmpOpNeq), drop())},
		{"spoofed arp mac", cat(etherType(unix.ETH_P_ARP), arpSender(8, p.MAC, expr.CmpOpNeq), drop())},
	}
	if p.IPv4.IsValid() {
		// The sender address is the guest's, or 0.0.0.0 in a probe.
		rules = append(rules, taggedRule{"spoofed arp address", cat(etherType(unix.ETH_P_ARP),
			arpSender(14, p.IPv4.AsSlice(), expr.CmpOpNeq), &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}}, drop())})
	}
	rules = append(rules,
		taggedRule{"arp", cat(etherType(unix.ETH_P_ARP), verdict(expr.VerdictAccept))},
		taggedRule{"dhcp server", cat(etherType(unix.ETH_P_IP), udpPort(0, 67), drop())})
	if p.IPv4.IsValid() {
		rules = append(rules,
			taggedRule{"dhcp request", cat(etherType(unix.ETH_P_IP), match(offSaddr, netip.PrefixFrom(netip.IPv4Unspecified(), 32), expr.CmpOpEq),
				udpPort(2, 67), verdict(expr.VerdictAccept))},
			taggedRule{"spoofed address", cat(etherType(unix.ETH_P_IP), match(offSaddr, netip.PrefixFrom(p.IPv4, 32), expr.CmpOpNeq), drop())})
	}
	rules = append(rules, taggedRule{"ipv4", cat(etherType(unix.ETH_P_IP), verdict(expr.VerdictAccept))})
	if p.IPv6 {
		rules = append(rules,
			taggedRule{"router advertisement", cat(etherType(unix.ETH_P_IPV6), l4proto(unix.IPPROTO_ICMPV6),
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{134}}, drop())},
			taggedRule{"dhcpv6 server", cat(etherType(unix.ETH_P_IPV6), udpPort(0, 547), drop())},
			taggedRule{"ipv6", cat(etherType(unix.ETH_P_IPV6), verdict(expr.VerdictAccept))})
	}
	// VLAN tags and other ethertypes would pass under the checks above.
	rules = append(rules, taggedRule{"other", drop()})
	name := portChainName(p.Name)
	if err := rebuildChain(nsfd, portTable, portsChain, name, rules); err != nil {
		return err
	}
	return ensureJump(nsfd, portTable, portsChain, portTag(p.Name), cat(ifname(expr.MetaKeyIIFNAME, p.Name), jump(name)))
}

// deletePortFence removes a port's chain and jump.
func deletePortFence(nsfd int, port string) error {
	return deleteJumped(nsfd, portTable, portTag(port), map[*nftables.Chain]string{portsChain: portChainName(port)})
}

type taggedRule struct {
	tag   string
	exprs []expr.Any
}

// rebuildChain makes the regular chain name in t, with rules and nothing
// else, in one transaction; the table and base chain are made if missing.
func rebuildChain(nsfd int, t *nftables.Table, base *nftables.Chain, name string, rules []taggedRule) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	c.AddTable(t)
	c.AddChain(base)
	ch := c.AddChain(&nftables.Chain{Name: name, Table: t})
	c.FlushChain(ch)
	for _, r := range rules {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs, UserData: []byte(r.tag)})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: write chain %s of table %s: %w", name, t.Name, err)
	}
	return nil
}

// establishedTag tags the first rule of each fence base chain: replies to
// what was let through (or what the host opened) pass.
const establishedTag = "established"

// ensureJump adds the rule tagged tag to base unless it is there, after
// the base chain's established rule (made first when missing).
func ensureJump(nsfd int, t *nftables.Table, base *nftables.Chain, tag string, exprs []expr.Any) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	rules, err := c.GetRules(t, base)
	if err != nil {
		return fmt.Errorf("nftables: list chain %s: %w", base.Name, err)
	}
	has := func(tag string) bool {
		for _, r := range rules {
			if bytes.Equal(r.UserData, []byte(tag)) {
				return true
			}
		}
		return false
	}
	if t.Family == nftables.TableFamilyINet && !has(establishedTag) {
		c.InsertRule(&nftables.Rule{Table: t, Chain: base, UserData: []byte(establishedTag),
			Exprs: cat(ctEstablished(), verdict(expr.VerdictAccept))})
	}
	if !has(tag) {
		c.AddRule(&nftables.Rule{Table: t, Chain: base, Exprs: exprs, UserData: []byte(tag)})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: add rule %q to chain %s: %w", tag, base.Name, err)
	}
	return nil
}

// deleteJumped deletes the jumps tagged tag and the chains they reach
// (base chain -> regular chain), then the table t when no jump is left in
// it. Nothing there is not an error.
func deleteJumped(nsfd int, t *nftables.Table, tag string, chains map[*nftables.Chain]string) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	if _, err := c.ListTableOfFamily(t.Name, t.Family); err != nil {
		return nil // no table: nothing of the fence
	}
	left := 0
	var errs []error
	for base, name := range chains {
		rules, err := c.GetRules(t, base)
		if err != nil {
			continue // no base chain
		}
		for _, r := range rules {
			switch {
			case bytes.Equal(r.UserData, []byte(tag)):
				if err := c.DelRule(r); err != nil {
					errs = append(errs, err)
				}
			case !bytes.Equal(r.UserData, []byte(establishedTag)):
				left++
			}
		}
		if _, err := c.ListChain(t, name); err == nil {
			c.FlushChain(&nftables.Chain{Name: name, Table: t})
			c.DelChain(&nftables.Chain{Name: name, Table: t})
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("nftables: delete %q: %w", tag, err)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: delete %q: %w", tag, err)
	}
	if left == 0 && len(chains) > 0 {
		// Other base chains of the table (forward and input are deleted
		// together) may hold jumps of this network only: counted above.
		if err := deleteTableIfIdle(nsfd, t); err != nil {
			return err
		}
	}
	return nil
}

// deleteTableIfIdle deletes t when its base chains hold no rule but the
// established ones.
func deleteTableIfIdle(nsfd int, t *nftables.Table) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	chains, err := c.ListChainsOfTableFamily(t.Family)
	if err != nil {
		return fmt.Errorf("list nftables chains: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name != t.Name || ch.Hooknum == nil {
			continue
		}
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return fmt.Errorf("nftables: list chain %s: %w", ch.Name, err)
		}
		for _, r := range rules {
			if !bytes.Equal(r.UserData, []byte(establishedTag)) {
				return nil
			}
		}
	}
	c.DelTable(t)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: delete table %s: %w", t.Name, err)
	}
	return nil
}

// Expressions. Each leaves its comparison in register 1.

func cat(parts ...any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		switch v := p.(type) {
		case []expr.Any:
			out = append(out, v...)
		case expr.Any:
			out = append(out, v)
		}
	}
	return out
}

func verdict(k expr.VerdictKind) expr.Any { return &expr.Verdict{Kind: k} }

func jump(chain string) expr.Any { return &expr.Verdict{Kind: expr.VerdictJump, Chain: chain} }

func drop() []expr.Any { return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}} }

// ifname: <iifname|oifname> == name (exactly: the kernel compares the
// name with its terminating zero).
func ifname(key expr.MetaKey, name string) []expr.Any {
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(name + "\x00")}}
}

// ifnamePrefix: <iifname|oifname> == prefix*.
func ifnamePrefix(key expr.MetaKey, prefix string) []expr.Any {
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(prefix)}}
}

func nfproto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

func ipv4() []expr.Any { return nfproto(unix.NFPROTO_IPV4) }

func l4proto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

// udpPort: udp <sport (offset 0)|dport (2)> == port.
func udpPort(offset uint32, port uint16) []expr.Any {
	return cat(l4proto(unix.IPPROTO_UDP),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: offset, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)})
}

func ctEstablished() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}},
	}
}

// etherType: ether type == typ (bridge family).
func etherType(typ uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(typ)},
	}
}

func etherSaddr(mac net.HardwareAddr, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
		&expr.Cmp{Op: op, Register: 1, Data: []byte(mac)},
	}
}

// arpSender: the ARP sender hardware (offset 8) or protocol (14) address
// of an Ethernet/IPv4 ARP packet compared with want.
func arpSender(offset uint32, want []byte, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: uint32(len(want))},
		&expr.Cmp{Op: op, Register: 1, Data: want},
	}
}
