package control

import (
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
)

// maxStoredRejections bounds the rejected hosts a VM row lists in its
// placement explanation. A placement that falls to the slow path rejects
// every host that cannot take the VM; at 3,000 hosts the full list is
// ~250 KB in each VM row, returned on every GET and list page. The row
// keeps the first ones and a count per reason for all; POST /v1/placements
// (the dry run) still explains every host.
const maxStoredRejections = 20

// capRejections sets p's rejections from rs, capped for storage.
func capRejections(p api.Placement, rs []scheduler.Rejection) api.Placement {
	p.Rejected = apiRejections(rs[:min(len(rs), maxStoredRejections)])
	p.RejectedOmitted = len(rs) - len(p.Rejected)
	if len(rs) > 0 {
		p.RejectedCounts = make(map[string]int)
		for _, r := range rs {
			p.RejectedCounts[r.Reason]++
		}
	}
	return p
}
