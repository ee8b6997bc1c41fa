package control

import (
	"context"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// createFailedPrefix starts the reason of a VM row whose create failed and
// whose cleanup could not confirm the delete on its agent (failCreate): the
// row stays in error, holding capacity, until the cleanup is finished.
const createFailedPrefix = "create failed"

// cleanupPending reports whether row is such a failed create.
func cleanupPending(row store.VM) bool {
	return row.ObservedState == api.StateError && row.HoldsCapacity && row.ForkID == nil &&
		strings.HasPrefix(row.Reason, createFailedPrefix)
}

// finishFailedCreate is the host monitor's retry of a failed create's
// cleanup whose delete timed out: no caller was told the VM exists, so it
// is deleted on its agent (when the agent still has it) and its row and
// capacity go, as the create's own cleanup would have done. Each round
// tries again until the agent confirms; the row does not take the agent's
// state and hold capacity for ever.
func (s *Service) finishFailedCreate(ctx context.Context, host string, row store.VM, onAgent bool) {
	if onAgent {
		if err := s.deleteOnAgent(ctx, host, row.ID); err != nil {
			s.log.Warn("host monitor: delete of a failed create on its agent did not finish; the next round retries",
				"vm", row.ID, "host", host, "err", err)
			return
		}
	}
	if err := s.forgetVM(ctx, row.ID, host); err != nil {
		s.log.Error("host monitor: remove the row of a failed create", "vm", row.ID, "host", host, "err", err)
		return
	}
	s.log.Warn("finished the cleanup of a failed create: VM deleted on its agent, row removed, capacity released",
		"vm", row.ID, "name", row.Name, "host", host)
}
