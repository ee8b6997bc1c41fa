package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// The host monitor's reconcile of volumes (settleVolumes runs it each
// round for each live host): rows and the agent's volumes are brought to
// agree after a crash of the control API or of the agent, without ever
// making up data. A step a dead replica left is undone (a create: never
// acknowledged, so nothing of value is lost) or finished (a delete, a
// growth); a volume the agent lost is reported, never recreated empty; a
// volume the agent has without a row is deleted only when its row was
// deleted on purpose.

// undoUnfinishedVolumeCreate removes a volume whose create was left by its
// replica (state creating: its 201 was never sent, so no caller knows it
// and no VM has it): deleted on the agent first (the dead replica's PUT
// may have made it, or be finishing), then its row goes with its
// capacity, and its name is free for the caller's retry. Should the
// agent still make it later, it is a volume without a row whose row was
// deleted on purpose, which sweepOrphanVolumes removes.
func (s *Service) undoUnfinishedVolumeCreate(ctx context.Context, log *slog.Logger, c *agentapi.Client, v store.Volume) {
	if err := s.agents.call("delete_volume", func() error { return c.DeleteVolume(ctx, v.ID) }); err != nil {
		log.Debug("host monitor: undo unfinished volume create on its agent; the next round retries", "volume", v.ID, "err", err)
		return
	}
	if _, _, err := s.store.DeleteVolume(ctx, v.ID); err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			log.Error("host monitor: release a volume whose create never finished", "volume", v.ID, "err", err)
		}
		return
	}
	s.refreshHost(ctx, v.HostName)
	log.Warn("host monitor: a volume create never finished (its control replica died); volume deleted and its capacity released, so a retry of the create can run",
		"volume", v.ID, "name", v.Name, "size_mib", v.SizeMiB)
}

// reconcileReadyVolume brings a ready volume's row and its agent's copy
// together: a growth left half done (the row reserved it, the agent did
// not grow, or the other way round) is finished once no replica runs it,
// and a volume the agent confirms it does not have is marked lost.
func (s *Service) reconcileReadyVolume(ctx context.Context, log *slog.Logger, c *agentapi.Client, l leases, v store.Volume, a agentapi.Volume, onAgent bool) {
	if v.State != store.VolumeReady || !v.HoldsCapacity {
		return
	}
	if !onAgent {
		s.markVolumeLostIfGone(ctx, log, c, v)
		return
	}
	if a.SizeMiB == v.SizeMiB || !s.volumeAbandoned(l, v) {
		return // agrees, or a growth may still run
	}
	if a.SizeMiB < v.SizeMiB {
		// The growth was reserved and recorded, the agent never got (or
		// never answered) the resize: finish it; the agent grows to the
		// same size at most once.
		err := s.agents.call("resize_volume", func() error { _, err := c.ResizeVolume(ctx, v.ID, v.SizeMiB); return err })
		switch {
		case err == nil:
			log.Warn("host monitor: finished the growth of a volume that its agent had not applied", "volume", v.ID, "from_mib", a.SizeMiB, "to_mib", v.SizeMiB)
		case errors.Is(err, agentapi.ErrInvalid), errors.Is(err, agentapi.ErrConflict):
			if uerr := s.store.UndoGrowVolume(ctx, v.ID, a.SizeMiB, v.SizeMiB); uerr != nil {
				log.Error("host monitor: give back a volume growth its agent refused", "volume", v.ID, "err", uerr)
				return
			}
			s.refreshHost(ctx, v.HostName)
			log.Warn("host monitor: the agent refused a volume growth left unfinished; growth given back", "volume", v.ID,
				"size_mib", a.SizeMiB, "refused_mib", v.SizeMiB, "err", err)
		default:
			log.Debug("host monitor: finish volume growth", "volume", v.ID, "err", err)
		}
		return
	}
	// The agent grew it although the row gave the growth back (its answer
	// was lost): the disk is that big now, so reserve the difference.
	err := s.store.GrowVolume(ctx, v.ID, v.SizeMiB, a.SizeMiB)
	if err != nil {
		log.Error("host monitor: volume is larger on its agent than its row and the host cannot reserve the difference; "+
			"free disk on the host (the volume keeps working)", "volume", v.ID, "row_mib", v.SizeMiB, "agent_mib", a.SizeMiB, "err", err)
		return
	}
	s.refreshHost(ctx, v.HostName)
	log.Warn("host monitor: recorded the size a volume has on its agent", "volume", v.ID, "from_mib", v.SizeMiB, "to_mib", a.SizeMiB)
}

// markVolumeLostIfGone marks ready volume v lost when its agent confirms
// (404) that it does not have it. The list the caller compared with was
// read before the rows, so a volume made since is found here and kept.
// The volume is never made again empty: its data is gone, and the reason
// says so and what to do.
func (s *Service) markVolumeLostIfGone(ctx context.Context, log *slog.Logger, c *agentapi.Client, v store.Volume) {
	err := s.agents.call("get_volume", func() error { _, err := c.GetVolume(ctx, v.ID); return err })
	if !errors.Is(err, agentapi.ErrNotFound) {
		if err != nil {
			log.Debug("host monitor: look up a volume missing from its agent's list", "volume", v.ID, "err", err)
		}
		return
	}
	if err := s.store.MarkVolumeLost(ctx, v.ID, v.HostName, lostReason(v)); err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			log.Error("host monitor: mark volume lost", "volume", v.ID, "err", err)
		}
		return
	}
	s.metrics.volumesLost.WithLabelValues(v.HostName).Inc()
	log.Error("volume lost: its agent no longer has it; marked error", "volume", v.ID, "name", v.Name, "size_mib", v.SizeMiB)
}

// lostReason is the reason of volume v marked lost: what happened and
// what to do.
func lostReason(v store.Volume) string {
	return fmt.Sprintf("the agent of host %s does not have this volume's disk any more (its state directory lost it): "+
		"its data is gone unless that directory is restored from a backup; the volume is not recreated empty. "+
		"Delete it (DELETE /v1/volumes/%s) and create it again, or restore the host's volumes/%s directory (the volume is ready again once the agent has it)",
		v.HostName, v.ID, v.ID)
}

// reclaimLostVolume turns a volume marked lost back to ready when its
// agent has it again (its state directory was restored). Its capacity was
// held all along.
func (s *Service) reclaimLostVolume(ctx context.Context, log *slog.Logger, v store.Volume, a agentapi.Volume, onAgent bool) {
	if !onAgent || v.State != store.VolumeError || v.Reason != lostReason(v) {
		return
	}
	if a.SizeMiB != v.SizeMiB {
		log.Error("a lost volume is back on its agent with another size; kept in state error: delete it or restore the right copy",
			"volume", v.ID, "row_mib", v.SizeMiB, "agent_mib", a.SizeMiB)
		return
	}
	if err := s.store.MarkVolumeFound(ctx, v.ID, v.HostName, v.Reason); err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			log.Error("host monitor: mark volume found", "volume", v.ID, "err", err)
		}
		return
	}
	log.Warn("volume marked lost is on its agent again (restored); ready again", "volume", v.ID, "name", v.Name)
}

// sweepOrphanVolumes handles the volumes agent h has that no row of h
// names, once they are older than OrphanGrace: one whose row was deleted
// on purpose (a delete whose answer was lost, the undo of a create) is
// deleted on the agent; any other may hold the data of an acknowledged
// create the database lost (a power loss with --sqlite-sync normal, a
// restored backup, a row removed by hand), and is kept, logged and
// counted (kvmd_volumes_without_row) for an operator, as orphan VMs are
// (deletedOnPurpose). A volume attached to a VM on the agent is left to
// that VM's reconcile.
func (s *Service) sweepOrphanVolumes(ctx context.Context, log *slog.Logger, h store.Host, c *agentapi.Client, known map[string]bool, onAgent []agentapi.Volume) {
	unaccounted := 0
	defer func() { s.metrics.volumesWithoutRow.WithLabelValues(h.Name).Set(float64(unaccounted)) }()
	for _, a := range onAgent {
		if known[a.ID] || a.AttachedTo != "" || a.CreatedAt.IsZero() || time.Since(a.CreatedAt) < s.opts.OrphanGrace {
			continue
		}
		// The list was read before the rows: look the row up once more.
		if _, err := s.store.GetVolume(ctx, a.ID); !errors.Is(err, store.ErrNotFound) {
			if err != nil {
				log.Error("host monitor: look up orphan volume candidate", "volume", a.ID, "err", err)
			}
			continue
		}
		deleted, err := s.store.VolumeWasDeleted(ctx, a.ID)
		if err != nil {
			log.Error("host monitor: look up the delete of an orphan volume candidate", "volume", a.ID, "err", err)
			continue
		}
		if !deleted {
			unaccounted++
			log.Error("volume on its host without a database row, and the database never deleted it; it is kept with its data. "+
				"It may be an acknowledged create the database lost (a power loss with --sqlite-sync normal, a restored backup, a row removed by hand): "+
				"copy its data off the agent or delete it there (DELETE /v1/volumes/{id} on the agent API)",
				"volume", a.ID, "size_mib", a.SizeMiB, "created_at", a.CreatedAt)
			continue
		}
		if err := s.agents.call("delete_volume", func() error { return c.DeleteVolume(ctx, a.ID) }); err != nil {
			log.Warn("host monitor: delete orphan volume on its agent; the next round retries", "volume", a.ID, "err", err)
			continue
		}
		s.metrics.orphanVolumesDeleted.WithLabelValues(h.Name).Inc()
		log.Warn("deleted a volume that its agent had without a row in the database (the row had been deleted)", "volume", a.ID,
			"size_mib", a.SizeMiB, "created_at", a.CreatedAt)
	}
}

// agentRefused reports whether an agent's error is a definite refusal
// (a 4xx: it did nothing), as opposed to an answer that never came or a
// failure whose outcome is unknown.
func agentRefused(err error) bool {
	return errors.Is(err, agentapi.ErrInvalid) || errors.Is(err, agentapi.ErrConflict) || errors.Is(err, agentapi.ErrNotFound)
}

// maxVolumesInError bounds the volumes a refused retire names in its
// message (details list them all).
const maxVolumesInError = 10

// retireRefused is the answer of a retire the store refused: a host that
// still has volumes is 409 naming them, with what to do; other errors as
// usual.
func retireRefused(err error, host string) error {
	var ve *store.VolumesOnHostError
	if !errors.As(err, &ve) {
		return fromStore(err, "retire host "+host)
	}
	return volumesOnHost(err, host, ve.Volumes, "the retire finishes the delete), then retire again")
}

// volumesOnHost is the 409 of a retire or a deregistration of a host that
// still has volumes: it names them (details list them all) and says to
// move or delete them; then completes the sentence about deletes on a
// host that does not answer.
func volumesOnHost(err error, host string, vols []store.Volume, then string) error {
	names := make([]string, 0, len(vols))
	list := make([]map[string]any, 0, len(vols))
	for _, v := range vols {
		names = append(names, fmt.Sprintf("%s (%s, project %s)", v.Name, v.ID, v.Project))
		list = append(list, map[string]any{"id": v.ID, "name": v.Name, "project": v.Project, "state": v.State, "size_mib": v.SizeMiB})
	}
	shown := strings.Join(names[:min(len(names), maxVolumesInError)], ", ")
	if len(names) > maxVolumesInError {
		shown += fmt.Sprintf(" and %d more (details list them all)", len(names)-maxVolumesInError)
	}
	return &Error{Code: api.CodeConflict, Err: err,
		Message: fmt.Sprintf("host %s still has %d volumes: %s. Their data is on that host only: move each to another host "+
			"while its agent answers, or delete it (DELETE /v1/volumes/{id}; on a host that does not answer "+
			"the volume is kept deleting and %s", host, len(names), shown, then),
		Details: map[string]any{"host": host, "volumes": list}}
}
