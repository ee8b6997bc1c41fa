package network

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// NAT rules are nftables rules (github.com/google/nftables, over netlink):
// no iptables binary to depend on, rules tagged with their owner in the
// rule's user data so that one is found and deleted exactly, and a table of
// the agent's own ("kvmd") that never touches the operator's rules.
// Every rule of the agent is in table TableName, family ip.
const TableName = "kvmd"

var table = &nftables.Table{Family: nftables.TableFamilyIPv4, Name: TableName}

func natChain(name string, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
	return &nftables.Chain{Name: name, Table: table, Type: nftables.ChainTypeNAT, Hooknum: hook, Priority: prio}
}

var (
	postrouting = natChain("postrouting", nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource)
	prerouting  = natChain("prerouting", nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest)
)

// nftConn opens a connection in the namespace fd (-1: the agent's own).
func nftConn(nsfd int) (*nftables.Conn, error) {
	if nsfd < 0 {
		return nftables.New()
	}
	return nftables.New(nftables.WithNetNSFd(nsfd))
}

// Rule is one NAT rule of the agent, as listed for tests and operators.
type Rule struct {
	Chain string
	Tag   string // the rule's owner, e.g. "masquerade lan"
}

// ListRules lists the agent's NAT rules in the namespace nsfd (-1: its own).
func ListRules(nsfd int) ([]Rule, error) {
	c, err := nftConn(nsfd)
	if err != nil {
		return nil, err
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return nil, fmt.Errorf("list nftables tables: %w", err)
	}
	var out []Rule
	for _, t := range tables {
		if t.Name != TableName {
			continue
		}
		for _, ch := range []*nftables.Chain{postrouting, prerouting} {
			rules, err := c.GetRules(table, ch)
			if err != nil {
				continue // the chain does not exist
			}
			for _, r := range rules {
				out = append(out, Rule{Chain: ch.Name, Tag: string(r.UserData)})
			}
		}
	}
	return out, nil
}

// ensureRule adds rule (tagged tag) to chain unless a rule with that tag is
// there already.
func ensureRule(nsfd int, ch *nftables.Chain, tag string, exprs []expr.Any) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	c.AddTable(table)
	c.AddChain(ch)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: add table %s chain %s: %w", TableName, ch.Name, err)
	}
	rules, err := c.GetRules(table, ch)
	if err != nil {
		return fmt.Errorf("nftables: list chain %s: %w", ch.Name, err)
	}
	for _, r := range rules {
		if bytes.Equal(r.UserData, []byte(tag)) {
			return nil
		}
	}
	c.AddRule(&nftables.Rule{Table: table, Chain: ch, Exprs: exprs, UserData: []byte(tag)})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: add rule %q: %w", tag, err)
	}
	return nil
}

// deleteRule deletes the rules tagged tag; none is not an error.
func deleteRule(nsfd int, ch *nftables.Chain, tag string) error {
	c, err := nftConn(nsfd)
	if err != nil {
		return err
	}
	rules, err := c.GetRules(table, ch)
	if err != nil {
		return nil // no table or chain: no rule
	}
	found := false
	for _, r := range rules {
		if bytes.Equal(r.UserData, []byte(tag)) {
			if err := c.DelRule(r); err != nil {
				return fmt.Errorf("nftables: delete rule %q: %w", tag, err)
			}
			found = true
		}
	}
	if !found {
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: delete rule %q: %w", tag, err)
	}
	return nil
}

// match loads the IPv4 source (offset 12) or destination (16) address into
// register 1, masked to prefix, and compares it with op.
func match(offset uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	mask := net.CIDRMask(p.Bits(), 32)
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: op, Register: 1, Data: p.Masked().Addr().AsSlice()},
	}
}

const (
	offSaddr = 12
	offDaddr = 16
)

func masqTag(network string) string { return "masquerade " + network }

// masquerade: ip saddr cidr ip daddr != cidr masquerade.
func masquerade(cidr netip.Prefix) []expr.Any {
	e := match(offSaddr, cidr, expr.CmpOpEq)
	e = append(e, match(offDaddr, cidr, expr.CmpOpNeq)...)
	return append(e, &expr.Masq{})
}

// natTo: ip <field> == from <snat|dnat> to to.
func natTo(offset uint32, from, to netip.Addr, typ expr.NATType) []expr.Any {
	e := match(offset, netip.PrefixFrom(from, 32), expr.CmpOpEq)
	return append(e,
		&expr.Immediate{Register: 1, Data: to.AsSlice()},
		&expr.NAT{Type: typ, Family: unix.NFPROTO_IPV4, RegAddrMin: 1})
}
