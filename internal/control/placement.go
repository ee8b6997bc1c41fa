package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

const (
	// fastAttempts is how many candidates from the host view a placement
	// tries before it reloads every host from the database.
	fastAttempts = 8
	// slowRounds bounds the reload-and-retry rounds under heavy contention,
	// and slowCandidates the hosts tried per round.
	slowRounds     = 4
	slowCandidates = 16
	// maxRejectionsInError bounds the per-host reasons of a 409.
	maxRejectionsInError = 1000
)

// placeAndReserve chooses a host for vm and reserves its capacity in the
// database together with the VM row. It tries the best candidates of the
// (possibly stale) host view first; each lost race refreshes that host and
// moves on to the next best. Only when that fails does it reload every
// host and rank them all, which also yields the explanation of a 409.
func (s *Service) placeAndReserve(ctx context.Context, vm *store.VM, p vmNICs, req scheduler.Request) error {
	start := time.Now()
	vm.NICs = p.nics // the same array: address changes below show in the row
	withNICs(&req, p, vm.Guest != nil)
	err := s.assignAddresses(ctx, p, 0)
	if err == nil {
		err = s.reserve(ctx, vm, p, req)
	}
	s.metrics.placementSeconds.Observe(time.Since(start).Seconds())
	var e *Error
	switch {
	case err == nil:
		s.metrics.placements.WithLabelValues(resultPlaced).Inc()
		if slices.ContainsFunc(p.nets, func(n store.Network) bool { return n.Mode == api.NetworkOverlay }) {
			// The other hosts learn where the new NIC is before it boots.
			s.kickOverlays()
		}
	case errors.As(err, &e) && e.Code == api.CodeNoCapacity:
		s.metrics.placements.WithLabelValues(resultNoCapacity).Inc()
		if rs, ok := e.Details["rejected"].([]api.Rejection); ok {
			s.metrics.countRejections(rs)
		}
	default:
		s.metrics.placements.WithLabelValues(resultError).Inc()
	}
	return err
}

func (s *Service) reserve(ctx context.Context, vm *store.VM, p vmNICs, req scheduler.Request) error {
	if err := s.groupFacts(ctx, &req); err != nil {
		return err
	}
	for range fastAttempts {
		res, a, ok := s.view.pick(req)
		if !ok {
			break
		}
		done, err := s.tryReserve(ctx, vm, p, &req, res, a)
		if done || err != nil {
			return err
		}
	}
	for range slowRounds {
		if err := s.reloadViewSince(ctx, time.Now()); err != nil {
			return internal(err, "reload hosts for placement")
		}
		if err := s.groupFacts(ctx, &req); err != nil {
			return err
		}
		res := s.view.rankAll(req)
		if len(res.Ranked) == 0 {
			return noCapacity(req, res)
		}
		for i := range min(len(res.Ranked), slowCandidates) {
			a := s.view.assume(res.Ranked[i].Host, req.Resources)
			explained := scheduler.Result{Ranked: res.Ranked[i:], Rejected: res.Rejected}
			done, err := s.tryReserve(ctx, vm, p, &req, explained, a)
			if done || err != nil {
				return err
			}
		}
	}
	return unavailable(nil, "placement of VM %q kept losing reservation races to other requests; retry", vm.Name)
}

// tryReserve reserves on the best host of res (already assumed as a). It
// reports done when the VM is placed; false with no error means the host
// (or the group's slots in its domain) filled up meanwhile and the caller
// tries the next one.
func (s *Service) tryReserve(ctx context.Context, vm *store.VM, p vmNICs, req *scheduler.Request, res scheduler.Result, a assumption) (bool, error) {
	best := res.Ranked[0]
	vm.HostName = best.Host
	if req.Constraints.Group != "" {
		host, _ := s.view.get(best.Host)
		vm.Group = groupSlot(req.Constraints, host)
	}
	runnerUp := bestScored(res.Ranked)
	vm.Placement = placementJSONNote(*req, best, res.Rejected, joinNotes(
		imageNote(*req, best, runnerUp, s.view.localMargin), warmNote(best, runnerUp, s.view.warmMargin), guestNote(*vm)))
	err := s.store.ReserveAndInsertVM(ctx, *vm)
	// An address or MAC taken meanwhile: the host still fits, so try it
	// again with new ones (the unique indexes of vm_nics decided).
	for attempt := 0; errors.Is(err, store.ErrAddressTaken) || errors.Is(err, store.ErrMACTaken); attempt++ {
		s.metrics.conflicts.Inc()
		if rerr := s.retryAfterNICConflict(ctx, vm, p, err, attempt); rerr != nil {
			s.view.undo(a)
			return false, rerr
		}
		err = s.store.ReserveAndInsertVM(ctx, *vm)
	}
	if err == nil {
		for _, r := range res.Rejected {
			s.metrics.rejections.WithLabelValues(r.Reason).Inc()
		}
		return true, nil
	}
	s.view.undo(a)
	switch {
	case errors.Is(err, store.ErrGroupCap):
		// Another create of the group took the domain's last slot: this
		// placement counts it full from now on (the next reload of the
		// facts reads the database again).
		s.metrics.conflicts.Inc()
		counts := maps.Clone(req.Constraints.Counts)
		if counts == nil {
			counts = map[string]int{}
		}
		counts[vm.Group.Domain] = max(counts[vm.Group.Domain], vm.Group.Cap)
		req.Constraints.Counts = counts
		return false, nil
	case errors.Is(err, store.ErrNoRoom):
		s.metrics.conflicts.Inc()
		s.refreshHost(ctx, best.Host)
		return false, nil
	case errors.Is(err, store.ErrDuplicateName):
		return false, s.nameTaken(ctx, vm.Project, vm.Name, err)
	case isQuota(err):
		// No other host helps: the project is full, not the host.
		return false, fromStore(err, "reserve capacity")
	case errors.Is(err, store.ErrProjectChanged):
		// placeInProject reads the project again and places again.
		return false, err
	case errors.Is(err, store.ErrNotFound):
		return false, notFoundf("host %s was deregistered during placement; retry", best.Host)
	}
	if verr, ok := volumeAttachError(err); ok {
		return false, verr
	}
	return false, internal(err, "reserve capacity on host "+best.Host)
}

// nameTaken is the 409 for a VM name in use; it names the existing VM.
func (s *Service) nameTaken(ctx context.Context, project, name string, cause error) error {
	existing, err := s.store.GetVMByName(ctx, project, name)
	if err != nil {
		return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("a VM named %q already exists", name), Err: cause}
	}
	return &Error{Code: api.CodeConflict, Err: cause,
		Message: fmt.Sprintf("a VM named %q already exists (id %s); choose another name or import that VM", name, existing.ID),
		Details: map[string]any{"existing_id": existing.ID, "name": name}}
}

func noCapacity(req scheduler.Request, res scheduler.Result) error {
	r := req.Resources
	shape := describeShape(req.Image, api.Resources{VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB})
	if req.Host != "" {
		res.Rejected = dropOtherHosts(res.Rejected, req.Host)
	}
	rejected := apiRejections(res.Rejected)
	details := map[string]any{"rejected_total": len(rejected)}
	if len(rejected) > maxRejectionsInError {
		rejected = rejected[:maxRejectionsInError]
	}
	details["rejected"] = rejected
	msg := fmt.Sprintf("no host can take %s: %d hosts rejected it (reasons per host in details)", shape, len(res.Rejected))
	if req.Host != "" {
		msg = fmt.Sprintf("pinned host %s cannot take %s", req.Host, shape)
		if len(res.Rejected) == 1 {
			msg += ": " + res.Rejected[0].Detail
		}
	}
	return &Error{Code: api.CodeNoCapacity, Message: msg, Details: details}
}

func apiRejections(rs []scheduler.Rejection) []api.Rejection {
	out := make([]api.Rejection, 0, len(rs))
	for _, r := range rs {
		out = append(out, api.Rejection{Host: r.Host, Reason: r.Reason, Detail: r.Detail})
	}
	return out
}

// placementJSONNote is the explanation a VM row keeps: the chosen host,
// its score and terms, and the rejections capped (storedPlacement).
func placementJSONNote(req scheduler.Request, best scheduler.Ranked, rejected []scheduler.Rejection, note string) string {
	p := api.Placement{Host: best.Host, Score: best.Score, Terms: placementTerms(req, best), Note: note}
	b, _ := json.Marshal(capRejections(p, rejected))
	return string(b)
}

// withNICs holds a placement to what the VM's NICs need: the hosts of its
// networks and, unless its one NIC is the user-mode one a warm VM has (and
// it has no guest configuration, whose seed a warm VM booted without), a
// cold boot. A create and the dry run both use it.
func withNICs(req *scheduler.Request, p vmNICs, guest bool) {
	req.NetworkHosts = networkHosts(p.nets)
	req.ColdOnly = !warmCapable(p) || guest
}

// Place is the dry run of POST /v1/placements: every host ranked, every
// rejection explained, nothing reserved. It checks what a create checks
// before and during placement, in the same order, with the same errors:
// volumes (the VM goes to their host), NICs (their networks' hosts), free
// addresses on the NICs' networks, then the hosts.
func (s *Service) Place(ctx context.Context, in api.PlacementRequest) (api.PlacementResult, error) {
	if err := validateShape(in.Image, in.VCPUs, in.MemoryMiB, in.DiskMiB); err != nil {
		return api.PlacementResult{}, err
	}
	if err := validateConstraints(in.Constraints); err != nil {
		return api.PlacementResult{}, err
	}
	// The dry run ranks the hosts a create of the caller's project could
	// use: its host labels apply.
	project, err := s.projectFor(ctx, "")
	if err != nil {
		return api.PlacementResult{}, err
	}
	if err := checkProjectLabels(in.Constraints, project); err != nil {
		return api.PlacementResult{}, err
	}
	_, _, volumeHost, err := s.vmVolumes(ctx, project.Name, in.Volumes)
	if err != nil {
		return api.PlacementResult{}, err
	}
	// MACs derive from a VM id; the dry run's are thrown away.
	nics, err := s.resolveNICs(ctx, newID(), project.Name, in.NetworkInterfaces)
	if err != nil {
		return api.PlacementResult{}, err
	}
	if err := s.checkFreeAddresses(ctx, nics); err != nil {
		return api.PlacementResult{}, err
	}
	req := scheduler.Request{Image: in.Image, Host: in.Host, VolumeHost: volumeHost,
		Resources:   scheduler.Resources{VCPUs: in.VCPUs, MemoryMiB: in.MemoryMiB, DiskMiB: in.DiskMiB},
		Constraints: schedConstraints(projectConstraints(in.Constraints, project))}
	withNICs(&req, nics, false)
	img, err := s.registeredImage(ctx, in.Image, in.DiskMiB)
	if err != nil {
		return api.PlacementResult{}, err
	}
	if img != nil {
		req.ImageSHA256 = img.SHA256
	}
	if err := s.groupFacts(ctx, &req); err != nil {
		return api.PlacementResult{}, err
	}
	res := s.view.rankAll(req)
	if in.Host != "" {
		if _, ok := s.view.get(in.Host); !ok {
			return api.PlacementResult{}, invalidf("host %q is not registered", in.Host)
		}
		res.Rejected = dropOtherHosts(res.Rejected, in.Host)
	}
	out := api.PlacementResult{Ranked: []api.RankedHost{}, Rejected: apiRejections(res.Rejected)}
	for _, r := range res.Ranked {
		out.Ranked = append(out.Ranked, api.RankedHost{Host: r.Host, Score: r.Score, Terms: placementTerms(req, r), WarmReady: r.WarmReady})
	}
	if best, ok := res.Best(); ok {
		out.Host, out.Score = best.Host, best.Score
		runnerUp := bestScored(res.Ranked)
		out.Note = joinNotes(imageNote(req, best, runnerUp, s.view.localMargin), warmNote(best, runnerUp, s.view.warmMargin))
	}
	return out, nil
}

// dropOtherHosts keeps the pinned host's rejection only: the others were
// never candidates.
func dropOtherHosts(rs []scheduler.Rejection, host string) []scheduler.Rejection {
	var out []scheduler.Rejection
	for _, r := range rs {
		if r.Host == host {
			out = append(out, r)
		}
	}
	return out
}

// ReserveRequest is a VM to place and reserve without starting it.
type ReserveRequest struct {
	ID        string
	Name      string
	Image     string
	Resources api.Resources
	Labels    map[string]string
	// NetworkInterfaces as in a create (nil: one NIC on "default"); their
	// addresses are allocated with the reservation.
	NetworkInterfaces []api.NetworkInterface
	// Constraints steer the placement as in a create.
	Constraints *api.Constraints
	// Project is the VM's project as in a create ("" for default): its
	// quotas and host labels apply.
	Project string
	// Volumes are attached as in a create: the VM goes to their host.
	Volumes []api.VMVolume
}

// Reserve places a VM and reserves its capacity (the VM row is inserted in
// state creating) without calling any agent. It is the placement half of a
// create, exposed for benchmarks and capacity tools; it returns the host.
func (s *Service) Reserve(ctx context.Context, r ReserveRequest) (string, error) {
	if err := validateName("name", r.Name); err != nil {
		return "", err
	}
	if err := validateShape(r.Image, r.Resources.VCPUs, r.Resources.MemoryMiB, r.Resources.DiskMiB); err != nil {
		return "", err
	}
	if err := validateConstraints(r.Constraints); err != nil {
		return "", err
	}
	if r.ID == "" {
		r.ID = newID()
	}
	project, err := s.placementProject(ctx, r.Project)
	if err != nil {
		return "", err
	}
	if err := checkProjectLabels(r.Constraints, project); err != nil {
		return "", err
	}
	vm := store.VM{ID: r.ID, Name: r.Name, Project: project.Name, Image: r.Image, Labels: r.Labels,
		Resources:  store.Resources{VCPUs: r.Resources.VCPUs, MemoryMiB: r.Resources.MemoryMiB, DiskMiB: r.Resources.DiskMiB},
		PowerState: api.PowerRunning, ObservedState: api.StateCreating, Constraints: constraintsText(r.Constraints)}
	var volumeHost string
	if vm.Volumes, _, volumeHost, err = s.vmVolumes(ctx, project.Name, r.Volumes); err != nil {
		return "", err
	}
	nics, err := s.resolveNICs(ctx, vm.ID, project.Name, r.NetworkInterfaces)
	if err != nil {
		return "", err
	}
	req := scheduler.Request{Image: r.Image, Resources: schedResources(vm.Resources), VolumeHost: volumeHost}
	if err := s.placeInProject(ctx, &vm, nics, req, r.Constraints, project); err != nil {
		return "", err
	}
	return vm.HostName, nil
}
