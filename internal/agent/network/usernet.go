package network

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The second fence of user-mode networking. Its first is passt's own
// (qemu/passt.go): the gateway is not mapped to the host's loopback. This
// one holds even when a guest addresses the host by one of its own
// addresses, or a private range behind it: passt opens the guest's
// connections with sockets of a uid of their own (--runas), and the
// output chain below refuses new connections of that uid to the host
// itself and to the ranges a guest has no business in, unless the
// operator allows a range.

// userNetChain is the agent's output filter for passt's uid.
var userNetChain = &nftables.Chain{Name: "usernet", Table: table, Type: nftables.ChainTypeFilter,
	Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter}

// UserNetBlocked are the IPv4 ranges a user-mode guest never reaches
// unless the operator allows them: loopback, this-network, link-local
// (cloud metadata), the private and shared ranges, multicast and
// broadcast. (passt runs IPv4-only: -4.)
var UserNetBlocked = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// UserNetFence is what FenceUserNet installs.
type UserNetFence struct {
	UID uint32 // passt's uid
	// Allow are ranges of UserNetBlocked the operator lets guests reach
	// (the host's own addresses stay out of reach).
	Allow []netip.Prefix
	// DNS are the host's resolvers: port 53 of each stays reachable, even
	// on the host's loopback, for passt's DNS forwarding.
	DNS []netip.Addr
}

// FenceUserNet (re)writes the agent's usernet chain: for new connections
// of f.UID, port 53 of the resolvers is accepted, the host's own addresses
// (fib daddr type local) are refused, the allowed ranges accepted, and the
// blocked ranges refused. Run again, it replaces the chain's rules at once.
func FenceUserNet(f UserNetFence) error {
	c, err := nftConn(-1)
	if err != nil {
		return err
	}
	c.AddTable(table)
	c.AddChain(userNetChain)
	c.FlushChain(userNetChain)
	add := func(tag string, e ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: table, Chain: userNetChain, Exprs: e, UserData: []byte(tag)})
	}
	uidNew := []expr.Any{
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(f.UID)},
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitNEW), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
	with := func(e ...[]expr.Any) []expr.Any {
		out := append([]expr.Any{}, uidNew...)
		for _, x := range e {
			out = append(out, x...)
		}
		return out
	}
	reject := []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: icmpPortUnreachable}}
	accept := []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	for _, r := range f.DNS {
		if !r.Is4() {
			continue
		}
		for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
			port := []expr.Any{
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(53)},
			}
			add("usernet dns "+r.String(), with(match(offDaddr, netip.PrefixFrom(r, 32), expr.CmpOpEq), port, accept)...)
		}
	}
	add("usernet host", with([]expr.Any{
		&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)},
	}, reject)...)
	for _, p := range f.Allow {
		if !p.Addr().Is4() {
			continue
		}
		add("usernet allow "+p.String(), with(match(offDaddr, p, expr.CmpOpEq), accept)...)
	}
	for _, p := range UserNetBlocked {
		add("usernet block "+p.String(), with(match(offDaddr, p, expr.CmpOpEq), reject)...)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: write chain %s of table %s (user-mode guests' fence): %w", userNetChain.Name, TableName, err)
	}
	return nil
}

// UserNetRules lists the tags of the usernet chain's rules (tests,
// operators).
func UserNetRules() ([]string, error) {
	c, err := nftConn(-1)
	if err != nil {
		return nil, err
	}
	rules, err := c.GetRules(table, userNetChain)
	if err != nil {
		return nil, nil //nolint:nilerr // no table or chain: no rule
	}
	var out []string
	for _, r := range rules {
		out = append(out, string(r.UserData))
	}
	return out, nil
}

// icmpPortUnreachable is the ICMP code a refused connection gets: the
// guest's connect fails at once (passt answers it with a reset).
const icmpPortUnreachable = 3
