package scheduler

import (
	"fmt"
	"strings"
)

// Spread domains: a group's VMs are counted per host, or per value of one
// host label (label:rack counts per rack).
const (
	SpreadByHost        = "host"
	SpreadByLabelPrefix = "label:"
)

// Constraints steer placement (docs/guides/placement.md). HostLabels is a hard
// filter. With a Group, the group's VMs are counted per domain (SpreadBy);
// fewer of them in a domain scores better (a soft term), and MaxPerDomain,
// when above 0, is a hard cap per domain.
type Constraints struct {
	HostLabels   map[string]string
	Group        string
	SpreadBy     string
	MaxPerDomain int
	// Counts is how many of the group's VMs each domain holds now: a fact
	// the caller reads from the database, so the scheduler stays pure.
	// Domains that are absent hold none.
	Counts map[string]int
}

// ValidateSpreadBy checks a spread_by value: "host" or "label:<key>".
func ValidateSpreadBy(spreadBy string) error {
	if spreadBy == SpreadByHost {
		return nil
	}
	key, ok := strings.CutPrefix(spreadBy, SpreadByLabelPrefix)
	if !ok || strings.TrimSpace(key) == "" || strings.TrimSpace(key) != key {
		return fmt.Errorf("spread_by must be %q or %q<key> (e.g. label:rack), got %q", SpreadByHost, SpreadByLabelPrefix, spreadBy)
	}
	return nil
}

// SpreadLabel is the host label that names a domain, or "" when the
// domain is the host.
func (c Constraints) SpreadLabel() string {
	key, _ := strings.CutPrefix(c.SpreadBy, SpreadByLabelPrefix)
	if key == c.SpreadBy {
		return ""
	}
	return key
}

// Domain is the failure domain h belongs to: its name, or the value of the
// spread label. A host without that label has no domain (false): it cannot
// take a VM of a group spread by that label, because the spread could not
// be counted.
func (c Constraints) Domain(h Host) (string, bool) {
	key := c.SpreadLabel()
	if key == "" {
		return h.Name, true
	}
	v, ok := h.Labels[key]
	return v, ok
}

func (c Constraints) describeDomain(domain string) string {
	if key := c.SpreadLabel(); key != "" {
		return fmt.Sprintf("domain %s=%s", key, domain)
	}
	return "host " + domain
}
