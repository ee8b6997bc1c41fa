package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// maxPerDomainLimit bounds max_per_domain: a larger cap is a typo.
const maxPerDomainLimit = 100000

// validateConstraints checks a constraints block. spread_by and
// max_per_domain act within a group, so either without a group is refused
// rather than silently ignored.
func validateConstraints(c *api.Constraints) error {
	if c == nil {
		return nil
	}
	if err := validateLabels(c.HostLabels); err != nil {
		var e *Error
		if errors.As(err, &e) {
			return invalidf("constraints.host_labels: %s", e.Message)
		}
		return err
	}
	if c.Group != "" {
		if err := validateName("constraints.group", c.Group); err != nil {
			return err
		}
	}
	if c.SpreadBy != "" {
		if err := scheduler.ValidateSpreadBy(c.SpreadBy); err != nil {
			return invalidf("constraints.%s", err.Error())
		}
		if key := strings.TrimPrefix(c.SpreadBy, scheduler.SpreadByLabelPrefix); key != c.SpreadBy && !labelKeyPattern.MatchString(key) {
			return invalidf("constraints.spread_by %q: %q is not a valid label key", c.SpreadBy, key)
		}
	}
	if c.MaxPerDomain < 0 || c.MaxPerDomain > maxPerDomainLimit {
		return invalidf("constraints.max_per_domain must be between 0 (no cap) and %d, got %d", maxPerDomainLimit, c.MaxPerDomain)
	}
	if c.Group == "" && c.SpreadBy != "" {
		return invalidf("constraints.spread_by %q needs constraints.group: it spreads the VMs of one group", c.SpreadBy)
	}
	if c.Group == "" && c.MaxPerDomain > 0 {
		return invalidf("constraints.max_per_domain %d needs constraints.group: it caps the VMs of one group per domain", c.MaxPerDomain)
	}
	return nil
}

// schedConstraints is the scheduler's form of c; a group without spread_by
// spreads by host. Counts are filled by groupFacts.
func schedConstraints(c *api.Constraints) scheduler.Constraints {
	if c == nil {
		return scheduler.Constraints{}
	}
	out := scheduler.Constraints{HostLabels: c.HostLabels, Group: c.Group, SpreadBy: c.SpreadBy, MaxPerDomain: c.MaxPerDomain}
	if out.Group != "" && out.SpreadBy == "" {
		out.SpreadBy = scheduler.SpreadByHost
	}
	return out
}

// groupFacts reads how many of the request's group each domain holds, as
// the database has it now: the facts the scheduler spreads and caps by.
func (s *Service) groupFacts(ctx context.Context, req *scheduler.Request) error {
	c := &req.Constraints
	if c.Group == "" {
		return nil
	}
	counts, err := s.store.GroupCounts(ctx, c.Group, c.SpreadBy)
	if err != nil {
		return internal(err, fmt.Sprintf("read the VMs of group %q per domain", c.Group))
	}
	c.Counts = counts
	return nil
}

// groupSlot is the slot a VM of req's group takes on host.
func groupSlot(c scheduler.Constraints, host scheduler.Host) store.GroupSlot {
	if c.Group == "" {
		return store.GroupSlot{}
	}
	domain, _ := c.Domain(host)
	return store.GroupSlot{Name: c.Group, SpreadBy: c.SpreadBy, Domain: domain, Cap: c.MaxPerDomain}
}

// constraintsText is how constraints are stored ("" for none).
func constraintsText(c *api.Constraints) string {
	if c == nil || (len(c.HostLabels) == 0 && c.Group == "" && c.SpreadBy == "" && c.MaxPerDomain == 0) {
		return ""
	}
	b, _ := json.Marshal(c)
	return string(b)
}

func parseConstraints(text string) *api.Constraints {
	if text == "" {
		return nil
	}
	var c api.Constraints
	if json.Unmarshal([]byte(text), &c) != nil {
		return nil
	}
	return &c
}

// constraintsViolated says how a host's labels (as they are now) fail a
// placed VM's constraints, or "" when they still hold. Only labels can
// change under a placed VM; group caps were settled at placement.
func constraintsViolated(c *api.Constraints, hostName string, labels map[string]string) string {
	if c == nil {
		return ""
	}
	var out []string
	for _, k := range slices.Sorted(maps.Keys(c.HostLabels)) {
		if v, ok := labels[k]; !ok {
			out = append(out, fmt.Sprintf("host %s no longer has label %s=%s (no label %s)", hostName, k, c.HostLabels[k], k))
		} else if v != c.HostLabels[k] {
			out = append(out, fmt.Sprintf("host %s no longer has label %s=%s (now %s=%s)", hostName, k, c.HostLabels[k], k, v))
		}
	}
	if key := schedConstraints(c).SpreadLabel(); c.Group != "" && key != "" {
		if _, ok := labels[key]; !ok {
			out = append(out, fmt.Sprintf("host %s no longer has the spread label %s", hostName, key))
		}
	}
	return strings.Join(out, "; ")
}
