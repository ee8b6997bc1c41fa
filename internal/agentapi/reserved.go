package agentapi

import "net/netip"

// reservedRanges are IPv4 ranges that are no network of guests: a network
// over them would give a guest the address of the host's loopback, of the
// link-local metadata service (169.254.169.254), or one no host routes.
var reservedRanges = []struct {
	prefix netip.Prefix
	what   string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), `"this network" (RFC 791), no destination`},
	{netip.MustParsePrefix("127.0.0.0/8"), "the host's loopback"},
	{netip.MustParsePrefix("169.254.0.0/16"), "link-local, where cloud metadata services answer (169.254.169.254)"},
	{netip.MustParsePrefix("224.0.0.0/4"), "multicast"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved (RFC 1112), with the broadcast address 255.255.255.255"},
}

// ReservedRange returns the reserved range a network's CIDR overlaps and
// what that range is, or ok false. The control plane refuses such a
// network; an agent refuses a NIC on one (a network made before the rule).
func ReservedRange(cidr netip.Prefix) (reserved netip.Prefix, what string, ok bool) {
	for _, r := range reservedRanges {
		if r.prefix.Overlaps(cidr) {
			return r.prefix, r.what, true
		}
	}
	return netip.Prefix{}, "", false
}
