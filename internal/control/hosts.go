package control

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// PutHost registers a host or updates it (idempotent). The capacity, accel,
// driver and images come from the agent's GET /v1/info, so the agent must
// answer; nothing is written when it does not.
func (s *Service) PutHost(ctx context.Context, name string, in api.HostPut) (api.Host, error) {
	if err := validateHostPut(name, in); err != nil {
		return api.Host{}, err
	}
	if err := s.checkAgentTransport(name, in.Address); err != nil {
		return api.Host{}, err
	}
	if h, err := s.store.GetHost(ctx, name); err == nil && h.RetiredAt != nil {
		return api.Host{}, &Error{Code: api.CodeConflict, Err: store.ErrHostRetired, Details: map[string]any{"host": name},
			Message: fmt.Sprintf("host %s was retired at %s and never comes back; delete it (DELETE /v1/hosts/%s, which also removes its lost VMs) and register it again",
				name, h.RetiredAt.Format(time.RFC3339), name)}
	}
	key, err := s.proveHost(ctx, name, in.Address, in.UnderlayAddress)
	if err != nil {
		return api.Host{}, err
	}
	info, err := s.agents.info(ctx, s.agents.client(in.Address))
	if err != nil {
		return api.Host{}, fromAgent(err, name, fmt.Sprintf("register host: GET /v1/info at %s", in.Address))
	}
	if peer := version.FromInfo(info.Release, info.APILevel); !version.Serves(peer.Level) {
		return api.Host{}, &Error{Code: api.CodeVersionSkew,
			Details: map[string]any{"host": name, "agent_release": peer.Release, "agent_api_level": peer.Level,
				"control_release": version.Release(), "control_api_level": version.Current()},
			Message: "register host: " + version.SkewError("control", peer, "agent of host "+name)}
	}
	h := store.Host{
		Name: name, Address: in.Address, Labels: in.Labels, Schedulable: true,
		CPUAllocationRatio: 1, Accel: info.Accel, Driver: info.Driver, Images: info.Images,
		Total: agentResources(info.Capacity), AgentKey: agentapi.EncodeKey(key),
		Warm: agentResources(info.Warm), Isolation: info.Isolation, UnderlayAddress: in.UnderlayAddress,
		AgentRelease: info.Release, AgentAPILevel: info.APILevel,
	}
	if in.Schedulable != nil {
		h.Schedulable = *in.Schedulable
	}
	if in.CPUAllocationRatio != nil {
		h.CPUAllocationRatio = *in.CPUAllocationRatio
	}
	if in.MemoryReservedMiB != nil {
		h.MemoryReservedMiB = *in.MemoryReservedMiB
	}
	h.Capacity = capacityOf(h.Total, h.CPUAllocationRatio, h.MemoryReservedMiB)
	for _, p := range in.WarmPool {
		h.WarmPool = append(h.WarmPool, store.PoolTarget{Image: p.Image, VCPUs: p.VCPUs, MemoryMiB: p.MemoryMiB, DiskMiB: p.DiskMiB, Size: p.Size})
	}
	// PUT is a full replace: no warm_pool means no targets, and the agent's
	// are cleared. They go to the agent first, so that targets it refuses
	// (unknown image, over its pool limit) save nothing; the host monitor
	// pushes them again whenever the agent's differ.
	if err := s.pushWarmPool(ctx, h, info.Pool); err != nil {
		return api.Host{}, err
	}
	saved, err := s.store.UpsertHost(ctx, h)
	if errors.Is(err, store.ErrAgentKeyTaken) {
		return api.Host{}, &Error{Code: api.CodeConflict, Err: err,
			Message: fmt.Sprintf("register host %s: the agent at %s is already registered as another host; one agent is one host", name, in.Address)}
	}
	if err != nil {
		return api.Host{}, fromStore(err, "save host "+name)
	}
	s.view.upsert(saved)
	s.log.Info("host registered", "host", name, "address", in.Address, "underlay_address", in.UnderlayAddress, "capacity", saved.Capacity, "images", saved.Images)
	s.kickOverlays()
	return s.withWarmReady(apiHost(saved)), nil
}

// proveHost makes the agent at address prove who it is before anything is
// sent to it with the agent token. A new host (or one registered before
// agents joined) must show a join proof made with the agent token; a known
// host's agent must sign with the key pinned when it joined, at whatever
// address the PUT gives: that is how the agent confirms a move, and why a
// PUT cannot hand a host, and its running VMs, to another agent.
//
// A host registered with an underlay address has its agent prove that
// address in the same challenge: an agent signs only its own.
func (s *Service) proveHost(ctx context.Context, name, address, underlay string) (ed25519.PublicKey, error) {
	var pinned ed25519.PublicKey
	existing, err := s.store.GetHost(ctx, name)
	switch {
	case errors.Is(err, store.ErrNotFound):
	case err != nil:
		return nil, fromStore(err, "read host "+name)
	case existing.AgentKey != "":
		if pinned, err = agentapi.DecodeKey(existing.AgentKey); err != nil {
			return nil, internal(err, "read the pinned agent key of host "+name)
		}
	}
	key, err := s.agents.verify(ctx, name, address, underlay, pinned, s.opts.AgentTimeout)
	var ae *agentapi.Error
	if underlay != "" && errors.As(err, &ae) && ae.Status == http.StatusForbidden {
		// Was it the underlay address the agent refused? It is when the
		// same challenge without it proves.
		if _, plain := s.agents.verify(ctx, name, address, "", pinned, s.opts.AgentTimeout); plain == nil {
			return nil, &Error{Code: api.CodeInvalid, Err: err, Details: map[string]any{"host": name, "field": "underlay_address", "underlay_address": underlay},
				Message: fmt.Sprintf("register host %s: the agent at %s refused to prove underlay_address %s: it is not the agent's own underlay address; "+
					"start the agent with --underlay-address %s (an address on one of its interfaces), or register the host with the underlay address the agent has",
					name, address, underlay, underlay)}
		}
	}
	if err != nil {
		return nil, identityError(err, name, address, pinned != nil, existing.Address)
	}
	other, err := s.store.HostWithAgentKey(ctx, agentapi.EncodeKey(key))
	switch {
	case err == nil && other.Name != name:
		return nil, conflictf("register host %s: the agent at %s is already registered as host %s (same identity key %s); one agent is one host",
			name, address, other.Name, agentapi.KeyFingerprint(key))
	case err != nil && !errors.Is(err, store.ErrNotFound):
		return nil, fromStore(err, "read hosts")
	}
	return key, nil
}

// identityError says why an address did not prove the agent identity,
// in the control plane's own words: nothing of what the address answered
// is repeated.
func identityError(err error, name, address string, known bool, knownAddress string) error {
	var ae *agentapi.Error
	switch {
	case errors.Is(err, agentapi.ErrBadIdentity) && known:
		what := "is not the agent of host " + name
		if knownAddress != address {
			what = fmt.Sprintf("is not the agent of host %s (which is at %s)", name, knownAddress)
		}
		return &Error{Code: api.CodeConflict, Err: err, Details: map[string]any{"host": name, "address": address},
			Message: fmt.Sprintf("host %s: the agent at %s %s: %v. A host keeps the agent identity it joined with; "+
				"to move it, run that agent (its --state-dir holds identity.key) at the new address; to give the name to another agent, delete the host and register it again",
				name, address, what, err)}
	case errors.Is(err, agentapi.ErrBadIdentity):
		return &Error{Code: api.CodeInvalid, Err: err, Details: map[string]any{"host": name, "address": address},
			Message: fmt.Sprintf("register host %s: the address %s did not prove it is an agent of this control plane (%v); "+
				"check that a kvmd agent runs there with the same agent token as --agent-token here", name, address, err)}
	case errors.As(err, &ae) && ae.Status == http.StatusForbidden && ae.Code == "forbidden":
		return &Error{Code: api.CodeInvalid, Err: err, Details: map[string]any{"host": name, "address": address},
			Message: fmt.Sprintf("register host %s: the agent at %s does not know itself by that address and refused to prove its identity for it; "+
				"start it with --advertise-url %s (or register it by the IP and port it listens on)", name, address, address)}
	case errors.As(err, &ae):
		return &Error{Code: api.CodeInvalid, Err: err, Details: map[string]any{"host": name, "address": address, "status": ae.Status},
			Message: fmt.Sprintf("register host %s: the address %s answered POST /v1/identity with %d %s: not a kvmd agent, or one too old to prove its identity",
				name, address, ae.Status, http.StatusText(ae.Status))}
	}
	return unavailable(err, "register host %s: the address %s did not answer the identity challenge; check the address and that the agent runs, then retry", name, address)
}

// GetHost returns one host.
func (s *Service) GetHost(ctx context.Context, name string) (api.Host, error) {
	h, err := s.store.GetHost(ctx, name)
	if err != nil {
		return api.Host{}, fromStore(err, "read host "+name)
	}
	return s.hostWithDrain(ctx, h)
}

// hostWithDrain is host h's answer; a host that drains (or drained) shows
// how many VMs it still holds.
func (s *Service) hostWithDrain(ctx context.Context, h store.Host) (api.Host, error) {
	out := s.withWarmReady(apiHost(h))
	if h.Drain.State != store.DrainNone {
		n, err := s.store.CountVMsOnHost(ctx, h.Name)
		if err != nil {
			return api.Host{}, fromStore(err, "count vms of host "+h.Name)
		}
		out.Drain.Remaining = n
	}
	return out, nil
}

// ListHosts returns one page of hosts, by name, each as GetHost answers it
// (drain progress included).
func (s *Service) ListHosts(ctx context.Context, p Page) (api.List[api.Host], error) {
	return listPage(p, func(after string, limit int) ([]store.Host, error) {
		hs, err := s.store.ListHosts(ctx, after, limit)
		return hs, fromStore(err, "list hosts")
	}, func(h store.Host) string { return h.Name }, func(hs []store.Host) ([]api.Host, error) {
		out := make([]api.Host, 0, len(hs))
		for _, h := range hs {
			a, err := s.hostWithDrain(ctx, h)
			if err != nil {
				return nil, err
			}
			out = append(out, a)
		}
		return out, nil
	})
}

// DeleteHost deregisters a host; a conflict while VMs are placed there.
// The lost VMs of a retired host run nowhere: they go with it.
func (s *Service) DeleteHost(ctx context.Context, name string) error {
	before, _ := s.store.GetHost(ctx, name)
	if before.RetiredAt != nil {
		vms, err := s.store.ListVMs(ctx, store.VMFilter{Host: name})
		if err != nil {
			return fromStore(err, "read the vms of host "+name)
		}
		for _, vm := range vms {
			if !api.Gone(vm.ObservedState) {
				continue // placed by nothing after the retire; kept for DeleteHost to refuse
			}
			if err := s.forgetVM(ctx, vm.ID, name); err != nil {
				return internal(err, fmt.Sprintf("delete lost vm %s of retired host %s", vm.ID, name))
			}
			s.log.Info("lost vm of a retired host deleted", "vm", vm.ID, "name", vm.Name, "host", name)
		}
	}
	err := s.store.DeleteHost(ctx, name)
	if errors.Is(err, store.ErrHostInUse) {
		if vols, verr := s.store.ListVolumes(ctx, store.VolumeFilter{Host: name}); verr == nil && len(vols) > 0 {
			return volumesOnHost(err, name, vols, "retiring the host finishes the delete), then delete the host again")
		}
		n, _ := s.store.CountVMsOnHost(ctx, name)
		return &Error{Code: api.CodeConflict, Err: err,
			Message: fmt.Sprintf("host %s still has %d VMs placed on it; delete them first", name, n),
			Details: map[string]any{"vms": n}}
	}
	if err != nil {
		return fromStore(err, "delete host "+name)
	}
	s.view.remove(name)
	s.log.Info("host deregistered", "host", name)
	s.clearWarmPool(ctx, before)
	return nil
}

func agentResources(r agentapi.Resources) store.Resources {
	return store.Resources{VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB}
}

// capacityOf applies the scheduler's capacity rule to store values.
func capacityOf(total store.Resources, cpuRatio float64, memoryReservedMiB int64) store.Resources {
	return storeResources(scheduler.Capacity(schedResources(total), cpuRatio, memoryReservedMiB))
}

func apiResources(r store.Resources) api.Resources {
	return api.Resources{VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB}
}

func apiHost(h store.Host) api.Host {
	out := api.Host{
		Name: h.Name, Address: h.Address, Labels: h.Labels, Schedulable: h.Schedulable, Alive: h.Alive,
		LastSeen: h.LastSeen, Accel: h.Accel, Driver: h.Driver, Images: h.Images,
		CPUAllocationRatio: h.CPUAllocationRatio, MemoryReservedMiB: h.MemoryReservedMiB,
		Capacity:  apiResources(h.Capacity),
		Allocated: apiResources(h.Allocated),
		Warm:      apiResources(h.Warm),
		// Free leaves out what VMs and warm VMs hold. A create may still
		// take the warm VMs' share: the agent evicts them for it.
		Free: api.Resources{VCPUs: max(0, h.Capacity.VCPUs-h.Allocated.VCPUs-h.Warm.VCPUs),
			MemoryMiB: max(0, h.Capacity.MemoryMiB-h.Allocated.MemoryMiB-h.Warm.MemoryMiB),
			DiskMiB:   max(0, h.Capacity.DiskMiB-h.Allocated.DiskMiB-h.Warm.DiskMiB)},
		WarmPool:  []api.WarmPoolTarget{},
		Isolation: h.Isolation,
		RetiredAt: h.RetiredAt,
		Drain:     apiDrain(h.Drain, 0),
		// The address its overlay tunnels run from ("" for none).
		UnderlayAddress: h.UnderlayAddress,
		AgentRelease:    h.AgentRelease, AgentAPILevel: h.AgentAPILevel, AgentRefused: h.AgentRefused,
	}
	if out.Labels == nil {
		out.Labels = map[string]string{}
	}
	if out.Images == nil {
		out.Images = []string{}
	}
	for _, p := range h.WarmPool {
		out.WarmPool = append(out.WarmPool, api.WarmPoolTarget{Image: p.Image, VCPUs: p.VCPUs, MemoryMiB: p.MemoryMiB, DiskMiB: p.DiskMiB, Size: p.Size})
	}
	return out
}

// RetireHost retires a host whose agent is gone for good (POST
// /v1/hosts/{name}/retire): in one transaction its VMs are marked lost and
// release their capacity, and the host takes no VM again (store.RetireHost).
// A host whose agent still answers is refused: its VMs still run, so drain
// it and delete them, or stop the agent first. Retiring a retired host
// changes nothing.
func (s *Service) RetireHost(ctx context.Context, name string) (api.Host, error) {
	h, err := s.store.GetHost(ctx, name)
	if err != nil {
		return api.Host{}, fromStore(err, "read host "+name)
	}
	if h.RetiredAt == nil && h.Alive {
		return api.Host{}, &Error{Code: api.CodeConflict, Details: map[string]any{"host": name},
			Message: fmt.Sprintf("host %s's agent still answers, so its VMs still run there; retire only a host whose agent is gone for good "+
				"(stop it and wait until the host shows alive = false), or drain it (schedulable = false) and delete its VMs", name)}
	}
	reason := fmt.Sprintf("host %s was retired: its agent is gone for good; delete this VM and create it again", name)
	retired, lost, err := s.store.RetireHost(ctx, name, api.StateLost, reason)
	if err != nil {
		return api.Host{}, retireRefused(err, name)
	}
	s.view.setWarm(name, nil)
	s.refreshHost(ctx, name)
	s.kickOverlays()
	if len(lost) > 0 || h.RetiredAt == nil {
		s.log.Warn("host retired: its vms are lost and their capacity released", "host", name, "lost_vms", len(lost), "vms", lost)
	}
	return apiHost(retired), nil
}
