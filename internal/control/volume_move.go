package control

// Moving a detached volume to another host (POST /v1/volumes/{id}/move),
// synchronous within moveTimeout:
//
//  1. reserve: one transaction reserves the volume's size on the target's
//     disk and turns the row moving with the target recorded
//     (store.BeginMoveVolume); GET shows state moving from here on.
//  2. digest: the source's agent exports the volume; the sha256 it sends
//     before the content is recorded in the row.
//  3. copy: the target's agent pulls the volume from the source's agent
//     (PUT /v1/volumes/{id} with source.peer: the source's address and
//     pinned identity key, and the digest, which the pull checks while
//     it streams; a file that differs is refused and nothing is kept).
//  4. switch: the row names the target (store.SwitchVolumeHost); the
//     source's share stays held while its copy exists.
//  5. the source's agent deletes its copy; its share is released and the
//     volume is ready on the target (store.FinishVolumeMove).
//
// A failure before the switch deletes the target's copy and releases its
// reservation (store.UndoVolumeMove): the volume stays ready where it was.
// A replica killed at any step leaves a row that names both hosts; the
// host monitor (settleVolumeMoves) finishes the move when the target has
// the complete copy (its recorded digest is the one the move recorded) and
// undoes it otherwise, and deletes an old copy left after the switch. The
// capacity of a host is never released before its agent confirmed that
// its copy is gone (or the host is retired).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Steps of a volume move, for Hooks.VolumeMoveStep.
const (
	MoveStepReserved = "reserved" // moving, the target's disk reserved
	MoveStepDigest   = "digest"   // the source's digest recorded
	MoveStepCopied   = "copied"   // the target's agent has the complete copy
	MoveStepSwitched = "switched" // the row names the target; the source's copy remains
)

// moveTimeout bounds a move, the copy included; it is below kvmd's write
// timeout (10 min), so the caller gets the answer. A move that runs out
// of time is undone (the target's agent gives up its pull after its own
// bound, and its copy is deleted).
const moveTimeout = 8 * time.Minute

// moveBusyTries and moveBusyWait bound how long a move waits for this
// replica's host monitor to let go of the volume (2 s).
const (
	moveBusyTries = 20
	moveBusyWait  = 100 * time.Millisecond
)

// moveCleanupTimeout bounds the undo of a failed move and each settle
// step of the host monitor.
const moveCleanupTimeout = time.Minute

// inflight is the set of volumes whose move this replica runs now: a
// request's or the host monitor's. The zero value is ready.
type inflight struct {
	mu  sync.Mutex
	ids map[string]bool
}

func (f *inflight) begin(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ids[id] {
		return false
	}
	if f.ids == nil {
		f.ids = map[string]bool{}
	}
	f.ids[id] = true
	return true
}

func (f *inflight) end(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.ids, id)
}

// MoveVolume moves a ready, detached volume to host in.Host and answers
// the volume on its new host. Moving it to the host it is on changes
// nothing.
func (s *Service) MoveVolume(ctx context.Context, ref string, in api.VolumeMove) (api.Volume, error) {
	if in.Host == "" {
		return api.Volume{}, invalidf("host is required: the name of the host to move the volume to")
	}
	if err := validateName("host", in.Host); err != nil {
		return api.Volume{}, err
	}
	ctx, cancel := detached(ctx, moveTimeout)
	defer cancel()
	v, err := s.visibleVolume(ctx, ref)
	if err != nil {
		return api.Volume{}, fromStore(err, "read volume "+ref)
	}
	if v.HostName == in.Host && v.State == store.VolumeReady {
		return s.GetVolume(ctx, v.ID)
	}
	if err := s.checkMove(ctx, v, in.Host); err != nil {
		return api.Volume{}, err
	}
	// The host monitor may hold the volume for a moment (it looks at a
	// move that just ended): wait a little before calling it busy.
	for i := 0; !s.volumeMoves.begin(v.ID); i++ {
		if i == moveBusyTries {
			return api.Volume{}, conflictf("volume %s (%s) is being moved by another request; retry when it is ready", v.Name, v.ID)
		}
		select {
		case <-ctx.Done():
			return api.Volume{}, unavailable(ctx.Err(), "volume %s (%s) is busy; retry", v.Name, v.ID)
		case <-time.After(moveBusyWait):
		}
	}
	defer s.volumeMoves.end(v.ID)
	// Read again now that no one else here runs a move of it.
	if v, err = s.store.GetVolume(ctx, v.ID); err != nil {
		return api.Volume{}, fromStore(err, "read volume "+ref)
	}
	if v.HostName == in.Host && v.State == store.VolumeReady {
		return s.GetVolume(ctx, v.ID)
	}
	if err := s.checkMove(ctx, v, in.Host); err != nil {
		return api.Volume{}, err
	}
	if err := s.moveVolume(ctx, v, in.Host); err != nil {
		return api.Volume{}, err
	}
	return s.GetVolume(ctx, v.ID)
}

// checkMove refuses a move that cannot start: a volume that is not ready
// or attached, a target host that is unknown, retired, cordoned or dead,
// a source host whose agent does not answer.
func (s *Service) checkMove(ctx context.Context, v store.Volume, target string) error {
	switch {
	case v.State == store.VolumeMoving:
		to := v.HostName
		if v.MoveTarget != nil {
			to = *v.MoveTarget
		}
		return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("volume %s (%s) is moving to host %s; retry when it is ready", v.Name, v.ID, to),
			Details: map[string]any{"volume_id": v.ID, "state": v.State, "host": to}}
	case v.State != store.VolumeReady:
		return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("volume %s (%s) is %s; only a ready volume moves", v.Name, v.ID, v.State),
			Details: map[string]any{"volume_id": v.ID, "state": v.State}}
	case v.RWVM != nil || v.Readers > 0:
		return s.moveAttached(ctx, v, nil)
	}
	if err := s.checkPlaceable(ctx, "", target); err != nil {
		return err
	}
	h, err := s.store.GetHost(ctx, target)
	if err != nil {
		return fromStore(err, "read host "+target)
	}
	switch {
	case h.RetiredAt != nil:
		return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("host %s is retired: a volume cannot move there; choose another host", target),
			Details: map[string]any{"host": target, "reason": "retired"}}
	case !h.Schedulable:
		return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("host %s is cordoned (not schedulable): a volume cannot move there; uncordon it or choose another host", target),
			Details: map[string]any{"host": target, "reason": "cordoned"}}
	case !h.Alive:
		return unavailable(nil, "host %s does not answer: its agent must pull the volume; retry when it is back", target)
	}
	if _, alive, _ := s.view.agent(v.HostName); !alive {
		return unavailable(nil, "host %s, where volume %s is, does not answer: its agent must send the volume; retry when it is back", v.HostName, v.ID)
	}
	return nil
}

// moveAttached is the 409 volume_attached of a move of an attached volume.
func (s *Service) moveAttached(ctx context.Context, v store.Volume, ae *store.VolumeAttachedError) error {
	if ae == nil {
		vm := ""
		if v.RWVM != nil {
			vm = *v.RWVM
		} else if atts, err := s.store.VolumeAttachments(ctx, []string{v.ID}); err == nil && len(atts[v.ID]) > 0 {
			vm = atts[v.ID][0].VMID
		}
		ae = &store.VolumeAttachedError{Volume: v.ID, VM: vm, ReadOnly: v.RWVM == nil}
	}
	return &Error{Code: api.CodeVolumeAttached, Err: ae,
		Message: fmt.Sprintf("volume %s (%s) is attached to VM %s; only a detached volume moves: detach it (remove it from that VM) or delete the VM first", v.Name, v.ID, ae.VM),
		Details: map[string]any{"volume_id": v.ID, "vm_id": ae.VM}}
}

// moveStep runs the test hook after a step; its error stops the move on
// the spot, like a process dying there.
func (s *Service) moveStep(ctx context.Context, id, step string) error {
	if s.hooks.VolumeMoveStep == nil {
		return nil
	}
	return s.hooks.VolumeMoveStep(ctx, id, step)
}

// moveVolume runs the steps of a move of v to target.
func (s *Service) moveVolume(ctx context.Context, v store.Volume, target string) error {
	source := v.HostName
	log := s.log.With("volume", v.ID, "from", source, "to", target)
	if _, err := s.store.BeginMoveVolume(ctx, v.ID, target, s.replicaID); err != nil {
		var ae *store.VolumeAttachedError
		switch {
		case errors.As(err, &ae):
			return s.moveAttached(ctx, v, ae)
		case errors.Is(err, store.ErrNoRoom):
			s.refreshHost(ctx, target)
			h, _ := s.view.get(target)
			free := max(h.Free().DiskMiB, 0)
			return &Error{Code: api.CodeNoCapacity, Err: err,
				Message: fmt.Sprintf("host %s cannot take volume %s of %d MiB: %d MiB of disk free", target, v.Name, v.SizeMiB, free),
				Details: map[string]any{"host": target, "size_mib": v.SizeMiB, "free_disk_mib": free, "shortfall_mib": max(v.SizeMiB-free, 0)}}
		case errors.Is(err, store.ErrVolumeNotReady):
			return &Error{Code: api.CodeConflict, Err: err, Message: err.Error() + "; only a ready volume moves, retry when it is ready"}
		case errors.Is(err, store.ErrMovePhase):
			return nil // on the target already
		}
		return fromStore(err, "reserve the move of volume "+v.ID)
	}
	s.refreshHost(ctx, target)
	log.Info("volume move started", "size_mib", v.SizeMiB)
	if err := s.moveStep(ctx, v.ID, MoveStepReserved); err != nil {
		return err
	}
	srcAddr, _, _ := s.view.agent(source)
	dstAddr, _, _ := s.view.agent(target)
	src, dst := s.agents.client(srcAddr), s.agents.client(dstAddr)

	var digest string
	err := s.agents.call("volume_digest", func() (err error) { digest, err = exportDigest(ctx, src, v.ID); return err })
	if err != nil {
		return s.undoMove(ctx, v, target, dst, s.moveAgentError(err, v, source, "read the content of volume "+v.ID+" on its host"))
	}
	if err := s.store.RecordMoveDigest(ctx, v.ID, target, digest); err != nil {
		return s.undoMove(ctx, v, target, dst, fromStore(err, "record the move of volume "+v.ID))
	}
	if err := s.moveStep(ctx, v.ID, MoveStepDigest); err != nil {
		return err
	}
	peer := agentapi.VolumePeer{Agent: agentURL(srcAddr), PublicKey: s.view.agentKey(source), Digest: digest}
	if err := s.pullVolume(ctx, dst, v, peer); err != nil {
		return s.undoMove(ctx, v, target, dst, s.moveAgentError(err, v, target, fmt.Sprintf("copy volume %s from host %s to host %s", v.ID, source, target)))
	}
	if err := s.moveStep(ctx, v.ID, MoveStepCopied); err != nil {
		return err
	}
	switched, err := s.store.SwitchVolumeHost(ctx, v.ID, target, fmt.Sprintf("moved from host %s; its copy there is being deleted", source))
	if err != nil {
		return s.undoMove(ctx, v, target, dst, fromStore(err, "switch volume "+v.ID+" to host "+target))
	}
	if err := s.moveStep(ctx, v.ID, MoveStepSwitched); err != nil {
		return err
	}
	if err := s.dropMoveSource(ctx, switched, src); err != nil {
		if errors.Is(err, errMoveReverted) {
			return unavailable(err, "%v; retry the move", err)
		}
		// The volume is on the target; the host monitor deletes the old
		// copy when the source answers. The answer says so (state moving).
		log.Warn("volume moved; its old copy is not deleted yet (the host monitor retries)", "err", err)
		return nil
	}
	log.Info("volume moved", "sha256", digest)
	return nil
}

// moveAgentError is the domain error of a failed agent call of a move: a
// volume the agent says is attached is 409 volume_attached.
func (s *Service) moveAgentError(err error, v store.Volume, host, what string) error {
	var ae *agentapi.Error
	if errors.As(err, &ae) && ae.Code == api.CodeVolumeAttached {
		return &Error{Code: api.CodeVolumeAttached, Err: err,
			Message: fmt.Sprintf("host %s says volume %s (%s) is attached: %s; detach it first", host, v.Name, v.ID, ae.Message),
			Details: map[string]any{"volume_id": v.ID}}
	}
	if ae != nil && ae.Status == 502 && ae.Message != "" {
		// The target's pull failed: the source, or the transfer (a digest
		// that does not match is refused there).
		return &Error{Code: api.CodeUnavailable, Err: err,
			Message: fmt.Sprintf("%s: %s; the volume stays where it was, retry the move", what, ae.Message)}
	}
	return fromAgent(err, host, what)
}

// exportDigest asks the source's agent for the volume's content and reads
// the sha256 it sends before the body; the body is not read.
func exportDigest(ctx context.Context, c *agentapi.Client, id string) (string, error) {
	body, sum, _, err := c.OpenVolumeContent(ctx, id)
	if err != nil {
		return "", err
	}
	_ = body.Close()
	if !isSHA256(sum) {
		return "", fmt.Errorf("agent sent volume %s content with digest %q, not a sha256: %w", id, sum, agentapi.ErrUnavailable)
	}
	return sum, nil
}

func isSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// peerDigest is the digest a volume on an agent was pulled with ("" when
// it was not pulled).
func peerDigest(v agentapi.Volume) string {
	if v.Source == nil || v.Source.Peer == nil {
		return ""
	}
	return v.Source.Peer.Digest
}

// pullVolume has the target's agent pull v from peer. The agent goes on
// pulling when a call times out, and the same PUT again waits for that
// pull, so a timeout is retried until ctx ends. A copy the target has
// from an earlier move (another digest or another spec: a leftover, not
// this content) is deleted and the pull made again, once.
func (s *Service) pullVolume(ctx context.Context, dst *agentapi.Client, v store.Volume, peer agentapi.VolumePeer) error {
	spec := agentapi.VolumeSpec{SizeMiB: v.SizeMiB, Source: &agentapi.VolumeSource{Peer: &peer}}
	stale := false
	for {
		var out agentapi.Volume
		err := s.agents.call("pull_volume", func() (err error) { out, err = dst.CreateVolume(ctx, v.ID, spec); return err })
		switch {
		case errors.Is(err, agentapi.ErrTimedOut) && ctx.Err() == nil:
			continue
		case err == nil && peerDigest(out) == peer.Digest:
			return nil
		case (err == nil || errors.Is(err, agentapi.ErrConflict)) && !stale:
			stale = true
			s.log.Warn("volume move: the target has another copy of the volume (left by an earlier move); deleting it",
				"volume", v.ID, "digest", peerDigest(out), "want", peer.Digest, "err", err)
			if derr := s.agents.call("delete_volume", func() error { return dst.DeleteVolume(ctx, v.ID) }); derr != nil {
				return derr
			}
			continue
		case err == nil:
			return fmt.Errorf("the target's copy of volume %s has digest %q, want %s: %w", v.ID, peerDigest(out), peer.Digest, agentapi.ErrConflict)
		}
		return err
	}
}

// undoMove takes back a move that failed before its switch: the target's
// copy is deleted, then its reservation released, and cause returned.
// When the target does not confirm the delete, the row stays moving for
// the host monitor to undo.
func (s *Service) undoMove(ctx context.Context, v store.Volume, target string, dst *agentapi.Client, cause error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), moveCleanupTimeout)
	defer cancel()
	log := s.log.With("volume", v.ID, "from", v.HostName, "to", target)
	log.Warn("volume move failed; undoing it", "err", cause)
	if err := s.agents.call("delete_volume", func() error { return dst.DeleteVolume(ctx, v.ID) }); err != nil && !s.hostGone(ctx, target) {
		log.Warn("volume move: the target did not confirm deleting its copy; the host monitor undoes the move", "err", err)
		return cause
	}
	if err := s.store.UndoVolumeMove(ctx, v.ID, target); err != nil && !errors.Is(err, store.ErrMovePhase) {
		log.Error("volume move: release the target's reservation; the host monitor undoes the move", "err", err)
		return cause
	}
	s.refreshHost(ctx, target)
	return cause
}

// dropMoveSource deletes the old copy of a switched volume on its source
// (a retired source has none) and releases the source's share. The new
// host must still have its copy: if it lost it, the switch is taken back
// and the move undone (the old copy is then the volume).
func (s *Service) dropMoveSource(ctx context.Context, v store.Volume, src *agentapi.Client) error {
	source := *v.MoveSource
	if err := s.checkMovedCopy(ctx, v); err != nil {
		return err
	}
	if err := s.agents.call("delete_volume", func() error { return src.DeleteVolume(ctx, v.ID) }); err != nil && !s.hostGone(ctx, source) {
		return err
	}
	if err := s.store.FinishVolumeMove(ctx, v.ID, source); err != nil && !errors.Is(err, store.ErrMovePhase) {
		return err
	}
	s.refreshHost(ctx, source)
	return nil
}

// hostGone reports whether host is retired or deregistered: it holds no
// files any more and its agent will not answer.
func (s *Service) hostGone(ctx context.Context, host string) bool {
	h, err := s.store.GetHost(ctx, host)
	if errors.Is(err, store.ErrNotFound) {
		return true
	}
	return err == nil && h.RetiredAt != nil
}

// settleVolumeMoves finishes or undoes the volume moves that involve host
// h and that their replica left (its lease lapsed, or this replica's
// request ended without finishing): before the switch, a move whose
// target has the complete copy (pulled with the digest the move
// recorded) is switched and finished, any other is undone (the target's
// copy deleted, its reservation released); after the switch, the old
// copy is deleted and the source's share released. A host that does not
// answer keeps its share until it does (or is retired).
func (s *Service) settleVolumeMoves(ctx context.Context, h store.Host, l leases) {
	rows, err := s.store.VolumeMovesOn(ctx, h.Name)
	if err != nil {
		s.log.Error("host monitor: read volume moves", "host", h.Name, "err", err)
		return
	}
	for _, v := range rows {
		if v.Owner != nil && *v.Owner != s.replicaID && (l.live == nil || l.live[*v.Owner]) {
			continue // its replica runs it
		}
		if !s.volumeMoves.begin(v.ID) {
			continue // a request or another host's pass here runs it
		}
		s.settleVolumeMove(ctx, v)
		s.volumeMoves.end(v.ID)
	}
}

func (s *Service) settleVolumeMove(ctx context.Context, v store.Volume) {
	ctx, cancel := context.WithTimeout(ctx, moveCleanupTimeout)
	defer cancel()
	if v.Owner == nil || *v.Owner != s.replicaID {
		took, err := s.store.TakeVolumeMove(ctx, v.ID, v.Owner, s.replicaID)
		if err != nil || !took {
			return // another replica took it
		}
	}
	v, err := s.store.GetVolume(ctx, v.ID)
	if err != nil {
		return
	}
	log := s.log.With("volume", v.ID, "host", v.HostName)
	if v.MoveTarget != nil {
		target := *v.MoveTarget
		gone := s.hostGone(ctx, target)
		if !gone {
			addr, alive, _ := s.view.agent(target)
			if !alive {
				log.Debug("host monitor: volume move waits for its target to answer", "target", target)
				return
			}
			dst := s.agents.client(addr)
			if v.State == store.VolumeMoving && v.MoveDigest != "" && !s.hostGone(ctx, v.HostName) {
				var got agentapi.Volume
				err := s.agents.call("get_volume", func() (err error) { got, err = dst.GetVolume(ctx, v.ID); return err })
				switch {
				case err == nil && peerDigest(got) == v.MoveDigest:
					switched, err := s.store.SwitchVolumeHost(ctx, v.ID, target, fmt.Sprintf("moved from host %s; its copy there is being deleted", v.HostName))
					if err != nil {
						log.Error("host monitor: switch a moved volume", "target", target, "err", err)
						return
					}
					log.Info("host monitor: the target has the complete copy of a volume its replica left moving; switched to it", "target", target)
					s.settleMoveSource(ctx, switched)
					return
				case err != nil && !errors.Is(err, agentapi.ErrNotFound):
					log.Debug("host monitor: read the target's copy of a moving volume", "target", target, "err", err)
					return
				}
			}
			if err := s.agents.call("delete_volume", func() error { return dst.DeleteVolume(ctx, v.ID) }); err != nil {
				log.Debug("host monitor: delete the target's copy of an unfinished volume move", "target", target, "err", err)
				return
			}
		}
		if err := s.store.UndoVolumeMove(ctx, v.ID, target); err != nil && !errors.Is(err, store.ErrMovePhase) {
			log.Error("host monitor: undo a volume move", "target", target, "err", err)
			return
		}
		s.refreshHost(ctx, target)
		log.Warn("host monitor: undid a volume move its replica left unfinished; the volume stays where it was (move it again)", "target", target)
		return
	}
	if v.MoveSource != nil {
		s.settleMoveSource(ctx, v)
	}
}

// settleMoveSource deletes the old copy of a switched volume when its
// source answers (or is gone) and releases the source's share.
func (s *Service) settleMoveSource(ctx context.Context, v store.Volume) {
	source := *v.MoveSource
	if err := s.checkMovedCopy(ctx, v); err != nil {
		s.log.Debug("host monitor: the old copy of a moved volume is kept", "volume", v.ID, "source", source, "err", err)
		return
	}
	if !s.hostGone(ctx, source) {
		addr, alive, _ := s.view.agent(source)
		if !alive {
			return
		}
		src := s.agents.client(addr)
		if err := s.agents.call("delete_volume", func() error { return src.DeleteVolume(ctx, v.ID) }); err != nil {
			s.log.Debug("host monitor: delete the old copy of a moved volume", "volume", v.ID, "source", source, "err", err)
			return
		}
	}
	if err := s.store.FinishVolumeMove(ctx, v.ID, source); err != nil && !errors.Is(err, store.ErrMovePhase) {
		s.log.Error("host monitor: finish a volume move", "volume", v.ID, "source", source, "err", err)
		return
	}
	s.refreshHost(ctx, source)
	s.log.Info("host monitor: deleted the old copy of a moved volume", "volume", v.ID, "source", source, "host", v.HostName)
}

// checkMovedCopy makes sure that the new host of switched volume v has its
// copy before the old one goes: nil when it does (or the new host is
// retired: its copy went with it and the row says so). A new host that
// says it does not have it (it lost it after the switch) gets the switch
// taken back (store.RevertVolumeSwitch): the move is then undone like one
// that failed before its switch, and the old copy stays the volume.
func (s *Service) checkMovedCopy(ctx context.Context, v store.Volume) error {
	if v.State != store.VolumeMoving || s.hostGone(ctx, v.HostName) {
		return nil
	}
	addr, _, _ := s.view.agent(v.HostName)
	dst := s.agents.client(addr)
	err := s.agents.call("get_volume", func() error { _, err := dst.GetVolume(ctx, v.ID); return err })
	if !errors.Is(err, agentapi.ErrNotFound) {
		return err
	}
	source := *v.MoveSource
	s.log.Error("volume move: the new host does not have the volume it took; taking the switch back, the old copy stays the volume",
		"volume", v.ID, "host", v.HostName, "source", source)
	if rerr := s.store.RevertVolumeSwitch(ctx, v.ID, source); rerr != nil && !errors.Is(rerr, store.ErrMovePhase) {
		return rerr
	}
	if uerr := s.store.UndoVolumeMove(ctx, v.ID, v.HostName); uerr != nil && !errors.Is(uerr, store.ErrMovePhase) {
		return uerr // the host monitor undoes it
	}
	s.refreshHost(ctx, v.HostName)
	return fmt.Errorf("host %s lost its copy of volume %s after the switch; the move is undone and the volume stays on host %s: %w",
		v.HostName, v.ID, source, errMoveReverted)
}

// errMoveReverted: a move's switch was taken back (checkMovedCopy).
var errMoveReverted = errors.New("move undone")
