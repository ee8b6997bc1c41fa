package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// volumeTimeout bounds a volume's create, resize or delete, agent call
// and cleanup included.
const volumeTimeout = 5 * time.Minute

// newVolumeID is a volume id: a random UUID (v4), because the guest's
// serial is the id's first 20 hex digits, which a time-ordered id would
// share between volumes made close together.
func newVolumeID() string { return uuid.NewString() }

// CreateVolume places (or takes the pinned host), reserves and makes a
// volume: reserve (DB, state creating) -> agent PUT -> ready (DB). A
// failure after the reservation deletes it on the agent before its
// capacity is released; a replica killed in between leaves a creating row
// that the host monitor finishes (settleVolumes).
func (s *Service) CreateVolume(ctx context.Context, in api.VolumeCreate) (api.Volume, error) {
	if err := validateVolumeCreate(in); err != nil {
		return api.Volume{}, err
	}
	ctx, cancel := detached(ctx, volumeTimeout)
	defer cancel()
	project, err := s.placementProject(ctx, in.Project)
	if err != nil {
		return api.Volume{}, err
	}
	if existing, err := s.store.GetVolumeByName(ctx, project.Name, in.Name); err == nil {
		return api.Volume{}, volumeNameTaken(existing)
	}
	v := store.Volume{ID: newVolumeID(), Name: in.Name, Project: project.Name, SizeMiB: in.SizeMiB,
		Labels: in.Labels, State: store.VolumeCreating, Owner: &s.replicaID}
	req := scheduler.Request{Host: in.Host, Resources: scheduler.Resources{DiskMiB: in.SizeMiB},
		Constraints: schedConstraints(projectConstraints(nil, project))}
	var img *store.Image
	if src := in.Source; src != nil {
		switch {
		case src.Volume != "":
			from, err := s.visibleVolume(ctx, src.Volume)
			if err != nil {
				return api.Volume{}, invalidf("source volume %q does not exist", src.Volume)
			}
			if from.State != store.VolumeReady {
				return api.Volume{}, conflictf("source volume %s (%s) is %s, not ready; retry when it is", from.Name, from.ID, from.State)
			}
			if in.Host != "" && in.Host != from.HostName {
				return api.Volume{}, &Error{Code: api.CodeInvalid,
					Message: fmt.Sprintf("source volume %s is on host %s, not on host %s: a clone is made on its source's host; leave host out or name %s",
						from.Name, from.HostName, in.Host, from.HostName),
					Details: map[string]any{"source_volume": from.ID, "source_host": from.HostName, "host": in.Host}}
			}
			if in.SizeMiB < from.SizeMiB {
				return api.Volume{}, invalidf("size_mib %d is below the %d MiB of source volume %s; give size_mib >= %d", in.SizeMiB, from.SizeMiB, from.Name, from.SizeMiB)
			}
			v.SourceVolume, req.Host = from.ID, from.HostName
		case src.Image != "":
			if img, err = s.registeredImage(ctx, src.Image, in.SizeMiB); err != nil {
				return api.Volume{}, err
			}
			if img == nil {
				if err := s.checkPlaceable(ctx, src.Image, ""); err != nil {
					return api.Volume{}, err
				}
				req.Image = src.Image
			} else if vs := s.apiImage(*img).VirtualSizeMiB; in.SizeMiB < vs {
				return api.Volume{}, invalidf("size_mib %d is below the %d MiB disk of image %s; give size_mib >= %d", in.SizeMiB, vs, img.Name, vs)
			}
			v.SourceImage = src.Image
		}
	}
	if err := s.checkPlaceable(ctx, "", req.Host); err != nil {
		return api.Volume{}, err
	}
	if err := s.placeVolume(ctx, &v, req); err != nil {
		return api.Volume{}, s.withShortfall(err, in.SizeMiB)
	}
	if err := s.makeVolume(ctx, v, img); err != nil {
		return api.Volume{}, err
	}
	s.log.Info("volume created", "volume", v.ID, "name", v.Name, "host", v.HostName, "size_mib", v.SizeMiB)
	return s.GetVolume(ctx, v.ID)
}

// placeVolume chooses the volume's host (the pinned one, or the best by
// score for its disk) and reserves its size there with the row, trying
// the next best host when one filled up meanwhile.
func (s *Service) placeVolume(ctx context.Context, v *store.Volume, req scheduler.Request) error {
	try := func(res scheduler.Result, a assumption) (bool, error) {
		best := res.Ranked[0]
		v.HostName = best.Host
		if req.Host == "" {
			v.Placement = placementJSONNote(req, best, res.Rejected, "")
		}
		err := s.store.ReserveAndInsertVolume(ctx, *v)
		if err == nil {
			return true, nil
		}
		s.view.undo(a)
		switch {
		case errors.Is(err, store.ErrNoRoom):
			s.metrics.conflicts.Inc()
			s.refreshHost(ctx, best.Host)
			return false, nil
		case errors.Is(err, store.ErrDuplicateName):
			if existing, gerr := s.store.GetVolumeByName(ctx, v.Project, v.Name); gerr == nil {
				return false, volumeNameTaken(existing)
			}
			return false, conflictf("a volume named %q already exists", v.Name)
		case errors.Is(err, store.ErrNotFound):
			return false, notFoundf("host %s was deregistered during placement; retry", best.Host)
		}
		return false, fromStore(err, "reserve volume "+v.Name)
	}
	for range fastAttempts {
		res, a, ok := s.view.pick(req)
		if !ok {
			break
		}
		if done, err := try(res, a); done || err != nil {
			return err
		}
	}
	for range slowRounds {
		if err := s.reloadViewSince(ctx, time.Now()); err != nil {
			return internal(err, "reload hosts for placement")
		}
		res := s.view.rankAll(req)
		if len(res.Ranked) == 0 {
			return volumeNoCapacity(req, res)
		}
		for i := range min(len(res.Ranked), slowCandidates) {
			a := s.view.assume(res.Ranked[i].Host, req.Resources)
			if done, err := try(scheduler.Result{Ranked: res.Ranked[i:], Rejected: res.Rejected}, a); done || err != nil {
				return err
			}
		}
	}
	return unavailable(nil, "placement of volume %q kept losing reservation races to other requests; retry", v.Name)
}

// volumeNoCapacity is the 409 of a volume no host can take: each host's
// reason, and for a pinned host its free disk and the shortfall.
func volumeNoCapacity(req scheduler.Request, res scheduler.Result) error {
	if req.Host != "" {
		res.Rejected = dropOtherHosts(res.Rejected, req.Host)
	}
	rejected := apiRejections(res.Rejected)
	details := map[string]any{"rejected_total": len(rejected), "size_mib": req.Resources.DiskMiB}
	if len(rejected) > maxRejectionsInError {
		rejected = rejected[:maxRejectionsInError]
	}
	details["rejected"] = rejected
	msg := fmt.Sprintf("no host can take a volume of %d MiB: %d hosts rejected it (reasons per host in details)", req.Resources.DiskMiB, len(res.Rejected))
	if req.Host != "" {
		details["host"] = req.Host
		msg = fmt.Sprintf("host %s cannot take a volume of %d MiB", req.Host, req.Resources.DiskMiB)
		if len(res.Rejected) == 1 {
			msg += ": " + res.Rejected[0].Detail
		}
	}
	if len(res.Rejected) == 1 && res.Rejected[0].Reason == scheduler.ReasonDisk {
		details["host"] = res.Rejected[0].Host
	}
	return &Error{Code: api.CodeNoCapacity, Message: msg, Details: details}
}

// withShortfall adds the free disk and the shortfall of the host a
// no_capacity error names (a pinned host, or the only one) to it.
func (s *Service) withShortfall(err error, sizeMiB int64) error {
	var e *Error
	if !errors.As(err, &e) || e.Code != api.CodeNoCapacity {
		return err
	}
	host, _ := e.Details["host"].(string)
	if h, ok := s.view.get(host); ok {
		free := max(h.Free().DiskMiB, 0)
		e.Details["free_disk_mib"] = free
		e.Details["shortfall_mib"] = max(sizeMiB-free, 0)
	}
	return err
}

// makeVolume asks the volume's agent to make it and marks it ready. On a
// failure the agent deletes it (if it made it) before the reservation goes.
func (s *Service) makeVolume(ctx context.Context, v store.Volume, img *store.Image) error {
	chain := &cleanup{log: s.log.With("volume", v.ID, "host", v.HostName)}
	chain.push("release volume", func(ctx context.Context) error {
		_, _, err := s.store.DeleteVolume(ctx, v.ID)
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			return err
		}
		s.refreshHost(ctx, v.HostName)
		return nil
	})
	address, _, _ := s.view.agent(v.HostName)
	agent := s.agents.client(address)
	chain.push("delete volume on agent", func(ctx context.Context) error {
		return s.agents.call("delete_volume", func() error { return agent.DeleteVolume(ctx, v.ID) })
	})
	fail := func(cause error) error {
		s.log.Warn("volume create failed; cleaning up", "volume", v.ID, "host", v.HostName, "err", cause)
		if err := chain.run(ctx); err != nil {
			// Never acknowledged, so nothing of value: left deleting (owned
			// by this replica) for the host monitor to finish once the
			// agent answers, which frees the name for a retry.
			reason := fmt.Sprintf("create failed (%v) and the agent of host %s did not confirm deleting it; the host monitor deletes it when the agent answers", cause, v.HostName)
			if serr := s.store.SetVolumeState(ctx, v.ID, store.VolumeDeleting, reason); serr != nil {
				s.log.Error("record failed volume create", "volume", v.ID, "err", serr)
			}
		}
		return cause
	}
	if img != nil {
		if err := s.awaitImage(ctx, agent, v.HostName, s.imageSource(*img, v.HostName)); err != nil {
			return fail(err)
		}
	}
	err := s.agents.call("create_volume", func() error {
		_, err := agent.CreateVolume(ctx, v.ID, volumeSpec(v))
		return err
	})
	if err != nil {
		return fail(fromAgent(err, v.HostName, "create volume "+v.ID))
	}
	if err := s.store.MarkVolumeReady(ctx, v.ID); err != nil {
		return fail(fromStore(err, "record created volume "+v.ID))
	}
	chain.commit()
	return nil
}

// volumeSpec is what the agent is asked to make for v.
func volumeSpec(v store.Volume) agentapi.VolumeSpec {
	spec := agentapi.VolumeSpec{SizeMiB: v.SizeMiB}
	if v.SourceImage != "" || v.SourceVolume != "" {
		spec.Source = &agentapi.VolumeSource{Image: v.SourceImage, Volume: v.SourceVolume, Snapshot: v.SourceSnapshot}
	}
	return spec
}

// GetVolume returns one volume by id or name.
func (s *Service) GetVolume(ctx context.Context, ref string) (api.Volume, error) {
	v, err := s.visibleVolume(ctx, ref)
	if err != nil {
		return api.Volume{}, fromStore(err, "read volume "+ref)
	}
	out, err := s.apiVolumes(ctx, []store.Volume{v})
	if err != nil {
		return api.Volume{}, err
	}
	return out[0], nil
}

// VolumeQuery filters and pages a volume list.
type VolumeQuery struct {
	Page
	Host string
}

// ListVolumes returns one page of the caller's volumes.
func (s *Service) ListVolumes(ctx context.Context, q VolumeQuery) (api.List[api.Volume], error) {
	return listPage(q.Page, func(after string, limit int) ([]store.Volume, error) {
		vols, err := s.store.ListVolumes(ctx, store.VolumeFilter{Project: principalOf(ctx).Project, Host: q.Host, After: after, Limit: limit})
		return vols, fromStore(err, "list volumes")
	}, func(v store.Volume) string { return v.ID }, func(vols []store.Volume) ([]api.Volume, error) { return s.apiVolumes(ctx, vols) })
}

// UpdateVolume grows a volume (never shrinks) and replaces its labels.
func (s *Service) UpdateVolume(ctx context.Context, ref string, in api.VolumePatch) (api.Volume, error) {
	if in.Labels != nil {
		if err := validateLabels(*in.Labels); err != nil {
			return api.Volume{}, err
		}
	}
	ctx, cancel := detached(ctx, volumeTimeout)
	defer cancel()
	v, err := s.visibleVolume(ctx, ref)
	if err != nil {
		return api.Volume{}, fromStore(err, "read volume "+ref)
	}
	if in.SizeMiB != nil {
		if err := s.growVolume(ctx, v, *in.SizeMiB); err != nil {
			return api.Volume{}, err
		}
	}
	if in.Labels != nil {
		if err := s.store.SetVolumeLabels(ctx, v.ID, *in.Labels); err != nil {
			return api.Volume{}, fromStore(err, "update labels of volume "+v.ID)
		}
	}
	return s.GetVolume(ctx, v.ID)
}

// ResizeVolume is POST /v1/volumes/{id}/resize: UpdateVolume's growth.
func (s *Service) ResizeVolume(ctx context.Context, ref string, in api.VolumeResize) (api.Volume, error) {
	return s.UpdateVolume(ctx, ref, api.VolumePatch{SizeMiB: &in.SizeMiB})
}

// growVolume reserves the growth, asks the agent to grow the volume
// (online when attached) and gives the growth back if the agent refused.
func (s *Service) growVolume(ctx context.Context, v store.Volume, to int64) error {
	switch {
	case to == v.SizeMiB:
		return nil
	case to < v.SizeMiB:
		return &Error{Code: api.CodeInvalid, Message: fmt.Sprintf("volume %s has %d MiB: a volume grows, never shrinks (asked %d MiB)", v.Name, v.SizeMiB, to),
			Details: map[string]any{"volume_id": v.ID, "size_mib": v.SizeMiB, "requested": to}}
	case v.State != store.VolumeReady:
		return conflictf("volume %s is %s; it grows only when ready", v.Name, v.State)
	}
	if err := s.store.GrowVolume(ctx, v.ID, v.SizeMiB, to); err != nil {
		if errors.Is(err, store.ErrNoRoom) {
			h, _ := s.view.get(v.HostName)
			free := max(h.Free().DiskMiB, 0)
			return &Error{Code: api.CodeNoCapacity, Err: err,
				Message: fmt.Sprintf("host %s cannot take %d MiB more for volume %s: %d MiB free", v.HostName, to-v.SizeMiB, v.Name, free),
				Details: map[string]any{"host": v.HostName, "free_disk_mib": free, "shortfall_mib": max(to-v.SizeMiB-free, 0)}}
		}
		if errors.Is(err, store.ErrNotFound) {
			return conflictf("volume %s changed while it was grown; read it and retry", v.Name)
		}
		return fromStore(err, "grow volume "+v.ID)
	}
	s.refreshHost(ctx, v.HostName)
	address, _, _ := s.view.agent(v.HostName)
	agent := s.agents.client(address)
	err := s.agents.call("resize_volume", func() error {
		_, err := agent.ResizeVolume(ctx, v.ID, to)
		return err
	})
	if err != nil {
		if !agentRefused(err) {
			// The agent may have grown it (its answer was lost): the row
			// keeps the growth, and the host monitor finishes it
			// (reconcileReadyVolume) once this request is over.
			s.log.Warn("volume growth: the agent's answer was lost; the host monitor finishes the growth", "volume", v.ID, "host", v.HostName, "err", err)
			return fromAgent(err, v.HostName, "grow volume "+v.ID)
		}
		if uerr := s.store.UndoGrowVolume(ctx, v.ID, v.SizeMiB, to); uerr != nil {
			s.log.Error("give back a volume growth the agent refused", "volume", v.ID, "err", uerr)
		}
		s.refreshHost(ctx, v.HostName)
		return fromAgent(err, v.HostName, "grow volume "+v.ID)
	}
	return nil
}

// DeleteVolume deletes a detached volume: mark deleting (DB) -> agent
// DELETE -> release and remove the row (DB). Attached: 409
// volume_attached naming the VM. The capacity is never released before
// the agent confirmed: a host that does not answer keeps the row deleting
// for the host monitor to finish.
func (s *Service) DeleteVolume(ctx context.Context, ref string) error {
	ctx, cancel := detached(ctx, volumeTimeout)
	defer cancel()
	v, err := s.visibleVolume(ctx, ref)
	if err != nil {
		return fromStore(err, "read volume "+ref)
	}
	marked, err := s.store.BeginDeleteVolume(ctx, v.ID, s.replicaID)
	if err != nil {
		var ae *store.VolumeAttachedError
		if errors.As(err, &ae) {
			return volumeAttached(v, ae)
		}
		return fromStore(err, "delete volume "+v.ID)
	}
	if err := s.finishVolumeDelete(ctx, marked); err != nil {
		return err
	}
	s.log.Info("volume deleted", "volume", v.ID, "name", v.Name, "host", v.HostName)
	return nil
}

// finishVolumeDelete deletes a volume marked deleting on its agent, then
// releases it (a retired host's volume holds nothing and has no agent).
func (s *Service) finishVolumeDelete(ctx context.Context, v store.Volume) error {
	address, alive, known := s.view.agent(v.HostName)
	if known && v.HoldsCapacity {
		if !alive {
			return unavailable(nil, "host %s does not answer, so volume %s is kept (state deleting) with its capacity reserved; the host monitor finishes the delete when the host is back (or retiring the host does)", v.HostName, v.ID)
		}
		agent := s.agents.client(address)
		err := s.agents.call("delete_volume", func() error { return agent.DeleteVolume(ctx, v.ID) })
		if err != nil {
			var ae *agentapi.Error
			if errors.As(err, &ae) && ae.Code == api.CodeVolumeAttached {
				// The agent knows an attachment the database does not:
				// keep the row, usable again.
				_ = s.store.SetVolumeState(ctx, v.ID, store.VolumeReady, "")
				return &Error{Code: api.CodeVolumeAttached, Err: err,
					Message: fmt.Sprintf("host %s says volume %s is attached: %s", v.HostName, v.ID, ae.Message)}
			}
			return fromAgent(err, v.HostName, "delete volume "+v.ID)
		}
	}
	if _, _, err := s.store.DeleteVolume(ctx, v.ID); err != nil && !errors.Is(err, store.ErrNotFound) {
		var ae *store.VolumeAttachedError
		if errors.As(err, &ae) {
			return volumeAttached(v, ae)
		}
		return internal(err, "release volume "+v.ID)
	}
	s.refreshHost(ctx, v.HostName)
	return nil
}

// volumeAttached is the 409 of a delete of an attached volume.
func volumeAttached(v store.Volume, ae *store.VolumeAttachedError) error {
	mode := "read-write"
	if ae.ReadOnly {
		mode = "read-only"
	}
	return &Error{Code: api.CodeVolumeAttached, Err: ae,
		Message: fmt.Sprintf("volume %s (%s) is attached %s to VM %s; delete or replace that VM first", v.Name, v.ID, mode, ae.VM),
		Details: map[string]any{"volume_id": v.ID, "vm_id": ae.VM}}
}

func volumeNameTaken(existing store.Volume) error {
	msg := fmt.Sprintf("a volume named %q already exists (id %s); choose another name or import that volume", existing.Name, existing.ID)
	if existing.State == store.VolumeDeleting {
		msg = fmt.Sprintf("a volume named %q (id %s) is being deleted (%s); retry once it is gone", existing.Name, existing.ID, existing.Reason)
	}
	return &Error{Code: api.CodeConflict,
		Message: msg,
		Details: map[string]any{"existing_id": existing.ID, "name": existing.Name}}
}

// visibleVolume reads a volume of the caller's project by id or name;
// another project's answers as unknown.
func (s *Service) visibleVolume(ctx context.Context, ref string) (store.Volume, error) {
	p := principalOf(ctx)
	if _, err := uuid.Parse(ref); err == nil {
		// Another project's id goes on to the lookup by name, like an
		// unknown id: both answer the same not_found.
		v, err := s.store.GetVolume(ctx, ref)
		switch {
		case err == nil && p.Sees(v.Project):
			return v, nil
		case err != nil && !errors.Is(err, store.ErrNotFound):
			return store.Volume{}, err
		}
	}
	project := p.Project
	if project == "" {
		project = api.DefaultProject
	}
	return s.store.GetVolumeByName(ctx, project, ref)
}

// apiVolumes converts volumes for the wire with their attachments.
func (s *Service) apiVolumes(ctx context.Context, vols []store.Volume) ([]api.Volume, error) {
	ids := make([]string, len(vols))
	for i, v := range vols {
		ids[i] = v.ID
	}
	atts, err := s.store.VolumeAttachments(ctx, ids)
	if err != nil {
		return nil, fromStore(err, "read volumes")
	}
	out := make([]api.Volume, 0, len(vols))
	for _, v := range vols {
		a := api.Volume{ID: v.ID, Name: v.Name, Project: v.Project, SizeMiB: v.SizeMiB, Host: v.HostName,
			Labels: v.Labels, State: v.State, Reason: v.Reason, Serial: agentapi.VolumeSerial(v.ID),
			Device: volumeDevice(v.ID), AttachedTo: []api.VolumeAttachment{}, CreatedAt: v.CreatedAt}
		if a.Labels == nil {
			a.Labels = map[string]string{}
		}
		if v.SourceImage != "" || v.SourceVolume != "" {
			a.Source = &api.VolumeSource{Image: v.SourceImage, Volume: v.SourceVolume}
		}
		for _, at := range atts[v.ID] {
			a.AttachedTo = append(a.AttachedTo, api.VolumeAttachment{VMID: at.VMID, ReadOnly: at.ReadOnly, State: attachmentState(at.State)})
		}
		if v.Placement != "" {
			var p api.Placement
			if json.Unmarshal([]byte(v.Placement), &p) == nil {
				a.Placement = &p
			}
		}
		out = append(out, a)
	}
	return out, nil
}

// volumeDevice is the path a guest sees volume id at.
func volumeDevice(id string) string { return "/dev/disk/by-id/virtio-" + agentapi.VolumeSerial(id) }

func validateVolumeCreate(in api.VolumeCreate) error {
	if err := validateName("name", in.Name); err != nil {
		return err
	}
	if in.SizeMiB <= 0 {
		return invalidf("size_mib must be positive, got %d", in.SizeMiB)
	}
	if in.Host != "" {
		if err := validateName("host", in.Host); err != nil {
			return err
		}
	}
	if src := in.Source; src != nil && src.Image != "" && src.Volume != "" {
		return invalidf("source names image %q and volume %q: give one of them", src.Image, src.Volume)
	}
	return validateLabels(in.Labels)
}

// vmVolumes resolves the volumes of a VM create in its project: each
// exists and is ready, none twice, all on one host (returned).
func (s *Service) vmVolumes(ctx context.Context, project string, in []api.VMVolume) ([]store.VMVolume, []store.Volume, string, error) {
	if len(in) == 0 {
		return nil, nil, "", nil
	}
	var (
		out  []store.VMVolume
		vols []store.Volume
		host string
	)
	byHost := map[string][]string{}
	for i, a := range in {
		if a.Volume == "" {
			return nil, nil, "", invalidf("volumes[%d].volume is required: a volume's name or id", i)
		}
		v, err := s.store.GetVolume(ctx, a.Volume)
		if err != nil || v.Project != project {
			v, err = s.store.GetVolumeByName(ctx, project, a.Volume)
		}
		if errors.Is(err, store.ErrNotFound) {
			return nil, nil, "", &Error{Code: api.CodeInvalid, Message: fmt.Sprintf("volumes[%d]: volume %q does not exist", i, a.Volume),
				Details: map[string]any{"volume": a.Volume}}
		}
		if err != nil {
			return nil, nil, "", fromStore(err, "read volume "+a.Volume)
		}
		if v.State != store.VolumeReady {
			return nil, nil, "", conflictf("volumes[%d]: volume %s (%s) is %s, not ready", i, v.Name, v.ID, v.State)
		}
		for _, o := range out {
			if o.VolumeID == v.ID {
				return nil, nil, "", invalidf("volumes[%d]: volume %s is named twice", i, v.Name)
			}
		}
		out = append(out, store.VMVolume{VolumeID: v.ID, ReadOnly: a.ReadOnly})
		vols = append(vols, v)
		byHost[v.HostName] = append(byHost[v.HostName], v.Name)
		host = v.HostName
	}
	if len(byHost) > 1 {
		hosts := slices.Sorted(maps.Keys(byHost))
		where := map[string]any{}
		for _, h := range hosts {
			where[h] = byHost[h]
		}
		return nil, nil, "", &Error{Code: api.CodeInvalid,
			Message: fmt.Sprintf("the VM's volumes are on %d hosts (%v): a VM attaches volumes of one host only", len(hosts), hosts),
			Details: map[string]any{"hosts": where}}
	}
	return out, vols, host, nil
}

// apiVMVolumes is the wire form of a VM's volumes.
func apiVMVolumes(atts []store.VMVolume, names map[string]string) []api.VMVolume {
	out := make([]api.VMVolume, 0, len(atts))
	for _, a := range atts {
		ref := names[a.VolumeID]
		if ref == "" {
			ref = a.VolumeID
		}
		out = append(out, api.VMVolume{Volume: ref, VolumeID: a.VolumeID, ReadOnly: a.ReadOnly,
			Serial: agentapi.VolumeSerial(a.VolumeID), Device: volumeDevice(a.VolumeID), State: attachmentState(a.State)})
	}
	return out
}

// agentVolumes is what the agent attaches to a VM.
func agentVolumes(atts []store.VMVolume) []agentapi.VolumeAttachment {
	var out []agentapi.VolumeAttachment
	for _, a := range atts {
		out = append(out, agentapi.VolumeAttachment{ID: a.VolumeID, ReadOnly: a.ReadOnly})
	}
	return out
}

// volumeAttachError is the answer of a VM create whose volume could not
// be attached.
func volumeAttachError(err error) (error, bool) {
	var ae *store.VolumeAttachedError
	switch {
	case errors.As(err, &ae):
		return &Error{Code: api.CodeConflict, Err: err,
			Message: fmt.Sprintf("volume %s is attached to VM %s; a volume attached read-write belongs to one VM (attach it read_only everywhere to share it)", ae.Volume, ae.VM),
			Details: map[string]any{"volume_id": ae.Volume, "vm_id": ae.VM}}, true
	case errors.Is(err, store.ErrVolumeNotReady):
		return &Error{Code: api.CodeConflict, Message: err.Error(), Err: err}, true
	}
	return nil, false
}

// settleVolumes reconciles host h's volume rows with its agent's volumes
// (volume_reconcile.go): a creating row whose owner lapsed (or that
// outlived the grace period) is undone on the agent and released (it was
// never acknowledged); a deleting row is deleted on the agent and
// released; a ready row gets a growth left half done finished, or is
// marked lost when the agent confirms it does not have it. Volumes the
// agent has with no row are swept after the orphan grace. The agent's
// list is read before the rows, so a volume whose row is being inserted
// now is never taken for a leftover.
func (s *Service) settleVolumes(ctx context.Context, h store.Host, c *agentapi.Client, l leases) {
	log := s.log.With("host", h.Name)
	var onAgent []agentapi.Volume
	if err := s.agents.call("list_volumes", func() (err error) { onAgent, err = c.ListVolumes(ctx); return err }); err != nil {
		log.Debug("host monitor: list volumes", "err", err)
		return
	}
	rows, err := s.store.ListVolumes(ctx, store.VolumeFilter{Host: h.Name})
	if err != nil {
		log.Error("host monitor: read volumes", "err", err)
		return
	}
	agentHas := make(map[string]agentapi.Volume, len(onAgent))
	for _, a := range onAgent {
		agentHas[a.ID] = a
	}
	known := map[string]bool{}
	for _, v := range rows {
		known[v.ID] = true
		if v.State == store.VolumeReady || v.State == store.VolumeError {
			a, ok := agentHas[v.ID]
			s.reconcileReadyVolume(ctx, log, c, l, v, a, ok)
			s.reclaimLostVolume(ctx, log, v, a, ok)
			continue
		}
		if v.State != store.VolumeCreating && v.State != store.VolumeDeleting {
			continue
		}
		if !s.volumeAbandoned(l, v) {
			continue
		}
		switch v.State {
		case store.VolumeCreating:
			if v.SourceSnapshot == "" {
				// Never acknowledged: undone (volume_reconcile.go).
				s.undoUnfinishedVolumeCreate(ctx, log, c, v)
				break
			}
			// A fork child's volume: its fork pass resumes and finds it by
			// name, so it is finished from the same frozen point.
			_, err := c.CreateVolume(ctx, v.ID, s.forkVolumeSpec(ctx, v))
			switch {
			case err == nil:
				if err := s.store.MarkVolumeReady(ctx, v.ID); err != nil && !errors.Is(err, store.ErrNotFound) {
					log.Error("host monitor: mark volume ready", "volume", v.ID, "err", err)
				}
				log.Info("host monitor: finished the create of a volume its replica left", "volume", v.ID)
			case errors.Is(err, agentapi.ErrInvalid), errors.Is(err, agentapi.ErrConflict):
				if derr := c.DeleteVolume(ctx, v.ID); derr == nil {
					_, _, _ = s.store.DeleteVolume(ctx, v.ID)
				}
				log.Warn("host monitor: the agent refused a volume its replica left creating; released it", "volume", v.ID, "err", err)
			default:
				log.Debug("host monitor: finish volume create", "volume", v.ID, "err", err)
			}
		case store.VolumeDeleting:
			if err := c.DeleteVolume(ctx, v.ID); err != nil {
				log.Debug("host monitor: finish volume delete", "volume", v.ID, "err", err)
				continue
			}
			if _, _, err := s.store.DeleteVolume(ctx, v.ID); err != nil && !errors.Is(err, store.ErrNotFound) {
				log.Error("host monitor: release deleted volume", "volume", v.ID, "err", err)
				continue
			}
			s.refreshHost(ctx, v.HostName)
			log.Info("host monitor: finished the delete of a volume its replica left", "volume", v.ID)
		}
	}
	s.sweepOrphanVolumes(ctx, log, h, c, known, onAgent)
}

// volumeAbandoned reports whether volume v's create or delete was left by
// its replica: its owner's lease lapsed, or (no owner known, or this
// replica, whose requests finish or clean up themselves) it is older than
// the grace period.
func (s *Service) volumeAbandoned(l leases, v store.Volume) bool {
	if v.Owner == nil || l.live == nil || *v.Owner == s.replicaID {
		return time.Since(v.UpdatedAt) >= s.opts.CreateGrace
	}
	return !l.live[*v.Owner]
}
