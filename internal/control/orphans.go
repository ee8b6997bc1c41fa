package control

import (
	"context"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// tombstoneAge is how long the tombstones of deleted VM rows are kept: an
// agent that comes back with a deleted VM later than this has it kept and
// reported instead of deleted.
const tombstoneAge = 30 * 24 * time.Hour

// deletedOnPurpose reports whether the row of VM v, which its agent runs
// without one, was deleted by the control plane (a failed create's cleanup,
// a delete): then the VM is an orphan to delete. Otherwise nothing in the
// database ever said it should go: it may be a create that was
// acknowledged and then lost by the database (a power loss with
// --sqlite-sync normal, a restore of a backup). It is kept running, logged
// and counted (kvmd_vms_without_row) for an operator to decide.
func (s *Service) deletedOnPurpose(ctx context.Context, host string, v agentapi.VM) bool {
	deleted, err := s.store.VMWasDeleted(ctx, v.ID)
	if err != nil {
		s.log.Error("host monitor: look up the delete of an orphan candidate", "vm", v.ID, "host", host, "err", err)
		return false
	}
	if !deleted {
		s.log.Error("VM runs on its host without a database row and the database never deleted it; it is kept running. "+
			"It may be an acknowledged create the database lost (a power loss with --sqlite-sync normal, or a restored backup): "+
			"re-create its row or delete it on the agent (DELETE /v1/vms/{id} on the agent API)",
			"vm", v.ID, "host", host, "created_at", v.CreatedAt, "vcpus", v.VCPUs, "memory_mib", v.MemoryMiB)
	}
	return deleted
}
