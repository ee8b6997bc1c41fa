package control

// Volumes move with their VM (issue 27). The read-write volumes of a VM
// are part of its migration (store.Migration.Volumes): the target's
// reservation holds their sizes with the VM's, the target gets a copy of
// each before its incoming VM is prepared, and the switch moves their
// rows (host and disk allocation) in the VM's transaction.
//
//   - live: the target gets empty volumes of the same ids and sizes, which
//     its incoming VMM exports beside its overlay; the source's VMM mirrors
//     each volume there (blockdev-mirror, sync=full) in the same stream as
//     the overlay, and they end in sync at the switch;
//   - cold: the target pulls each volume from the source (the volume
//     move's pull path: the chain flattened into one file, its sha256
//     checked while it streams, the pulled file checked for backing files
//     before the agent takes it). The cold files channel carries the VM's
//     own files only: a volume carried there would need a second copy of
//     those checks and would arrive without a digest.
//
// A volume shared read-only with other VMs stays where it is (the others
// read it there), and so does the VM: it is refused, reason volume.

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// reasonMigrationVolume is the details.reason of a migration refused for
// one of the VM's volumes.
const reasonMigrationVolume = "volume"

// migrationVolumesRefusal is the 409 (reason volume) of a VM with a volume
// that cannot move with it now, naming the volume and what to do.
func (s *Service) migrationVolumesRefusal(ctx context.Context, vm store.VM) error {
	atts, err := s.store.AttachmentsOfVMs(ctx, []string{vm.ID})
	if err != nil {
		return fromStore(err, "read volumes of vm "+vm.ID)
	}
	for _, a := range atts[vm.ID] {
		v, err := s.store.GetVolume(ctx, a.VolumeID)
		if err != nil {
			return fromStore(err, "read volume "+a.VolumeID)
		}
		refuse := func(format string, args ...any) error {
			return &Error{Code: api.CodeConflict, Message: fmt.Sprintf(format, args...),
				Details: map[string]any{"vm_id": vm.ID, "reason": reasonMigrationVolume, "volume_id": v.ID}}
		}
		switch {
		case a.State != store.AttachmentAttached:
			return refuse("volume %s (%s) of VM %s is %s: migrate the VM once that has settled", v.Name, v.ID, vm.ID, a.State)
		case a.ReadOnly && v.Readers > 1:
			return refuse("volume %s (%s) is attached read-only to VM %s and to %d other VMs, which read it on host %s: a shared volume does not move with a migration. "+
				"Detach it from VM %s (DELETE /v1/vms/%s/volumes/%s) to migrate the VM, or migrate none of them",
				v.Name, v.ID, vm.ID, v.Readers-1, v.HostName, vm.ID, vm.ID, v.ID)
		case a.ReadOnly:
			return refuse("volume %s (%s) is attached read-only to VM %s: read-only volumes, which other VMs may share, do not move with a migration. "+
				"Detach it, migrate the VM, move the volume (POST /v1/volumes/%s/move) and attach it again",
				v.Name, v.ID, vm.ID, v.ID)
		case v.State != store.VolumeReady:
			return refuse("volume %s (%s) of VM %s is %s: migrate the VM once the volume is ready", v.Name, v.ID, vm.ID, v.State)
		}
	}
	return nil
}

// migrationVolumeConflict is the 409 of a reservation the store refused
// for one of the VM's volumes (it changed since migratable looked).
func migrationVolumeConflict(vm store.VM, err error) error {
	details := map[string]any{"vm_id": vm.ID, "reason": reasonMigrationVolume}
	var ve *store.MigrationVolumeError
	if errors.As(err, &ve) {
		details["volume_id"] = ve.Volume
	}
	return &Error{Code: api.CodeConflict, Err: err, Details: details,
		Message: fmt.Sprintf("VM %s cannot migrate now: %v; retry once its volumes have settled", vm.ID, err)}
}

// migrationAttachments are the volumes the target's incoming VM has, in
// the order of the migration (the target takes their slots from the
// source's VM).
func migrationAttachments(m store.Migration) []agentapi.VolumeAttachment {
	var out []agentapi.VolumeAttachment
	for _, v := range m.Volumes {
		out = append(out, agentapi.VolumeAttachment{ID: v.ID})
	}
	return out
}

// prepareTargetVolumes gives the target its copy of each volume of m
// before its incoming VM is prepared: empty for a live migration (the
// source's mirror fills it), pulled from the source for a cold one.
func (s *Service) prepareTargetVolumes(ctx context.Context, m store.Migration, srcAddress, dstAddress string) error {
	src, dst := s.agents.client(srcAddress), s.agents.client(dstAddress)
	for _, v := range m.Volumes {
		if m.Live {
			err := s.agents.call("create_volume", func() error {
				_, err := dst.CreateVolume(ctx, v.ID, agentapi.VolumeSpec{SizeMiB: v.SizeMiB})
				return err
			})
			if errors.Is(err, agentapi.ErrConflict) {
				// A copy of another spec, left by an earlier cold
				// migration's pull: the mirror needs a plain one.
				if err = s.agents.call("delete_volume", func() error { return dst.DeleteVolume(ctx, v.ID) }); err == nil {
					err = s.agents.call("create_volume", func() error {
						_, err := dst.CreateVolume(ctx, v.ID, agentapi.VolumeSpec{SizeMiB: v.SizeMiB})
						return err
					})
				}
			}
			if err != nil {
				return fromAgent(err, m.TargetHost, fmt.Sprintf("make the copy of volume %s of VM %s", v.ID, m.VMID))
			}
			continue
		}
		var digest string
		if err := s.agents.call("volume_digest", func() (err error) { digest, err = exportDigest(ctx, src, v.ID); return err }); err != nil {
			return fromAgent(err, m.SourceHost, fmt.Sprintf("read the content of volume %s of VM %s", v.ID, m.VMID))
		}
		peer := agentapi.VolumePeer{Agent: agentURL(srcAddress), PublicKey: s.view.agentKey(m.SourceHost), Digest: digest}
		if err := s.pullVolume(ctx, dst, store.Volume{ID: v.ID, SizeMiB: v.SizeMiB}, peer); err != nil {
			return fromAgent(err, m.TargetHost, fmt.Sprintf("copy volume %s of VM %s from host %s", v.ID, m.VMID, m.SourceHost))
		}
	}
	return nil
}

// deleteMigrationVolumes deletes the copies of m's volumes on host, the
// end of the migration they no longer belong to: the target after an
// undo, the source after the switch. A copy on the host its row names is
// the volume itself and is never deleted.
func (s *Service) deleteMigrationVolumes(ctx context.Context, m store.Migration, host string) error {
	if len(m.Volumes) == 0 {
		return nil
	}
	address, _, known := s.view.agent(host)
	if !known {
		return nil
	}
	c := s.agents.client(address)
	for _, mv := range m.Volumes {
		v, err := s.store.GetVolume(ctx, mv.ID)
		switch {
		case errors.Is(err, store.ErrNotFound):
			continue // deleted since: the volume sweep decides about its copies
		case err != nil:
			return err
		case v.HostName == host:
			s.log.Warn("migration: not deleting a volume on the host its row names", "vm", m.VMID, "volume", v.ID, "host", host)
			continue
		}
		err = s.agents.call("delete_volume", func() error { return c.DeleteVolume(ctx, mv.ID) })
		if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
			return fmt.Errorf("delete the copy of volume %s on host %s: %w", mv.ID, host, err)
		}
	}
	return nil
}
