package control

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// MaxForkChildren bounds the children of one fork (per request and in total).
const MaxForkChildren = 64

// idempotencyScopeForks scopes the Idempotency-Keys of fork creates.
const idempotencyScopeForks = "POST /v1/forks"

// CreateFork forks a running VM into in.Count children (see "Forking" in
// docs/guides/architecture.md). With an idempotency key, a retry returns the same fork, and a retry
// after a failed or interrupted pass resumes that fork instead of making a
// second one. When the pass fails, the fork is kept (GET shows how far it
// got) and the error names it in details.fork_id.
func (s *Service) CreateFork(ctx context.Context, in api.ForkCreate, idempotencyKey string) (api.Fork, error) {
	if in.Placement == "" {
		in.Placement = api.PlacementColocate
	}
	if err := validateForkCreate(in); err != nil {
		return api.Fork{}, err
	}
	if idempotencyKey == "" {
		return s.createFork(ctx, in, "")
	}
	f, err := idempotent(ctx, s, idempotencyScopeForks, idempotencyKey, in, func(ctx context.Context) (api.Fork, error) {
		return s.createFork(ctx, in, idempotencyKey)
	})
	return f, s.nameInFlightFork(ctx, err, idempotencyKey)
}

func validateForkCreate(in api.ForkCreate) error {
	if in.SourceVMID == "" {
		return invalidf("source_vm_id is required")
	}
	if err := validateForkCount(in.Count); err != nil {
		return err
	}
	if in.Placement != api.PlacementColocate && in.Placement != api.PlacementSpread {
		return invalidf("placement must be %q or %q, got %q", api.PlacementColocate, api.PlacementSpread, in.Placement)
	}
	return validateForkConstraints(in.Constraints)
}

// validateForkConstraints accepts spread_by and max_per_domain without a
// group: a fork's children are a group of their own (the fork id) unless
// the constraints name one.
func validateForkConstraints(c *api.Constraints) error {
	if c == nil || c.Group != "" {
		return validateConstraints(c)
	}
	named := *c
	named.Group = "fork"
	return validateConstraints(&named)
}

func validateForkCount(n int) error {
	if n < 1 || n > MaxForkChildren {
		return invalidf("count must be between 1 and %d, got %d", MaxForkChildren, n)
	}
	return nil
}

func (s *Service) createFork(ctx context.Context, in api.ForkCreate, key string) (api.Fork, error) {
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	if key != "" {
		// A retry of a POST whose pass failed or was cut short: resume it.
		if f, err := s.store.GetForkByIdempotencyKey(ctx, callerOf(ctx), key); err == nil {
			if err := sameForkRequest(f, in, key); err != nil {
				return api.Fork{}, err
			}
			return s.forkPass(ctx, f.ID, true)
		}
	}
	src, err := s.visibleVM(ctx, in.SourceVMID)
	if errors.Is(err, store.ErrNotFound) {
		return api.Fork{}, invalidf("source VM %s does not exist", in.SourceVMID)
	}
	if err != nil {
		return api.Fork{}, fromStore(err, "read source vm "+in.SourceVMID)
	}
	// The children are the source's project's: its host labels hold them.
	project, err := s.projectFor(ctx, src.Project)
	if err != nil {
		return api.Fork{}, err
	}
	if err := checkProjectLabels(in.Constraints, project); err != nil {
		return api.Fork{}, err
	}
	if src.ObservedState != api.StateRunning {
		return api.Fork{}, conflictf("source VM %s is %s; only a running VM can be forked (start it first)", src.ID, src.ObservedState)
	}
	f := store.Fork{
		ID: newID(), SourceVMID: src.ID, SourceHost: src.HostName, Image: src.Image, Resources: src.Resources,
		Count: in.Count, PauseSource: in.PauseSource, Placement: in.Placement, Phase: api.ForkPending,
		NICs: src.NICs, Constraints: constraintsText(in.Constraints), Owner: &s.replicaID, Guest: src.Guest,
		Project: src.Project, GuestAgent: src.GuestAgent, SecureBoot: src.SecureBoot,
	}
	if key != "" {
		f.IdempotencyKey, f.IdempotencyCaller = &key, callerOf(ctx)
	}
	if err := s.store.InsertFork(ctx, f); err != nil {
		if key != "" && errors.Is(err, store.ErrDuplicateName) {
			if g, gerr := s.store.GetForkByIdempotencyKey(ctx, callerOf(ctx), key); gerr == nil {
				if err := sameForkRequest(g, in, key); err != nil {
					return api.Fork{}, err
				}
				return s.forkPass(ctx, g.ID, true)
			}
		}
		return api.Fork{}, fromStore(err, "record fork of vm "+src.ID)
	}
	s.log.Info("fork created", "fork", f.ID, "source", src.ID, "host", src.HostName, "count", f.Count, "placement", f.Placement)
	return s.forkPass(ctx, f.ID, true)
}

// GetFork returns a fork and its children.
func (s *Service) GetFork(ctx context.Context, id string) (api.Fork, error) {
	f, err := s.visibleFork(ctx, id)
	if err != nil {
		return api.Fork{}, fromStore(err, "read fork "+id)
	}
	children, err := s.forkChildren(ctx, id)
	if err != nil {
		return api.Fork{}, err
	}
	vms, err := s.apiVMs(ctx, children)
	if err != nil {
		return api.Fork{}, err
	}
	s.withGuestAddresses(ctx, f, vms)
	return api.Fork{
		ID: f.ID, Project: f.Project, SourceVMID: f.SourceVMID, Count: f.Count, PauseSource: f.PauseSource, Placement: f.Placement,
		SnapshotID: f.ID, SnapshotTaken: f.SnapshotTaken, Phase: f.Phase, Error: f.Error, Attempts: f.Attempts, Children: vms,
		Constraints: parseConstraints(f.Constraints), CreatedAt: f.CreatedAt, RetryAt: retryAt(f),
	}, nil
}

// UpdateFork changes the number of children in place: more come from the
// same snapshot, fewer removes the highest slots. New constraints apply to
// children placed from then on; running children never move. Any PATCH also resumes a
// fork whose last pass did not finish.
func (s *Service) UpdateFork(ctx context.Context, id string, in api.ForkPatch) (api.Fork, error) {
	if in.Count != nil {
		if err := validateForkCount(*in.Count); err != nil {
			return api.Fork{}, err
		}
	}
	if err := validateForkConstraints(in.Constraints); err != nil {
		return api.Fork{}, err
	}
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	if _, err := s.visibleFork(ctx, id); err != nil {
		return api.Fork{}, fromStore(err, "read fork "+id)
	}
	if in.Constraints != nil {
		if err := s.store.SetForkConstraints(ctx, id, constraintsText(in.Constraints)); err != nil {
			return api.Fork{}, fromStore(err, "update constraints of fork "+id)
		}
	}
	if in.Count != nil {
		if err := s.store.SetForkCount(ctx, id, *in.Count); err != nil {
			return api.Fork{}, fromStore(err, "update count of fork "+id)
		}
	}
	return s.forkPass(ctx, id, true)
}

// DeleteFork removes the children (each like a VM delete: agent first,
// then its capacity), then the snapshot on every agent that may hold it,
// then the fork. Deleting a fork that is gone succeeds.
func (s *Service) DeleteFork(ctx context.Context, id string) error {
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	unlock := s.forkLocks.lock(id)
	defer unlock()
	f, err := s.visibleFork(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fromStore(err, "read fork "+id)
	}
	children, err := s.forkChildren(ctx, id)
	if err != nil {
		return err
	}
	hosts := slices.Clone(f.SnapshotHosts)
	for _, c := range slices.Backward(children) {
		hosts = append(hosts, c.HostName)
		if err := s.DeleteVM(ctx, c.ID); err != nil && !isCode(err, api.CodeNotFound) {
			return fmt.Errorf("delete child %s of fork %s: %w", c.Name, id, err)
		}
	}
	hosts = append(hosts, f.SourceHost)
	slices.Sort(hosts)
	for _, h := range slices.Compact(hosts) {
		address, alive, known := s.view.agent(h)
		if !known {
			continue // deregistered: a host with VMs cannot be, and its files went with it
		}
		if !alive {
			return unavailable(nil, "host %s may hold the snapshot of fork %s but does not answer; retry the delete when it is back", h, id)
		}
		err := s.agents.deleteSnapshot(ctx, s.agents.client(address), id)
		if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
			return fromAgent(err, h, "delete snapshot of fork "+id)
		}
	}
	if err := s.store.DeleteFork(ctx, id); err != nil {
		return internal(err, "delete fork "+id)
	}
	s.log.Info("fork deleted", "fork", id, "children", len(children))
	return nil
}

// ResumeForks runs the pass of every fork whose last pass did not end
// ready and that nobody touched since `before` (after a crash or a
// failure); the host monitor calls it at start-up with its start time, so
// that forks which requests of this process are working on are left to them.
//
// A fork whose pass another replica runs (its lease is live) is left to it;
// one whose replica is gone is taken over first (a conditional write), so
// that replicas starting together do not both resume it.
func (s *Service) ResumeForks(ctx context.Context, before time.Time) {
	forks, err := s.store.UnfinishedForks(ctx, before)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("resume forks: list unfinished forks", "err", err)
		}
		return
	}
	l := s.readLeases(ctx)
	for _, f := range forks {
		if ctx.Err() != nil {
			return
		}
		if f.Owner != nil && *f.Owner != s.replicaID {
			if !l.lapsed(f.Owner) {
				continue // its replica runs it, or its lease has not lapsed yet (resumeLapsedForks)
			}
			if took, err := s.store.TakeFork(ctx, f.ID, f.Owner, s.replicaID); err != nil || !took {
				continue
			}
		}
		s.resumeFork(ctx, f.ID)
	}
}

// withGuestAddresses tells each child's NIC on a nat network the address
// its guest has inside: the source's at the fork point (f.NICs, by index),
// which the agent's namespace for the child translates to the child's own.
func (s *Service) withGuestAddresses(ctx context.Context, f store.Fork, children []api.VM) {
	for c := range children {
		for i := range children[c].NetworkInterfaces {
			nic := &children[c].NetworkInterfaces[i]
			if i >= len(f.NICs) || f.NICs[i].Network != nic.Network || f.NICs[i].IPv4Address == "" {
				continue
			}
			n, err := s.networks.get(ctx, s.store, nic.Network)
			if err != nil || n.Mode != api.NetworkNAT {
				continue
			}
			nic.GuestIPv4Address = f.NICs[i].IPv4Address
		}
	}
}

// retryAt is when a retrying fork's next pass is due (nil otherwise).
func retryAt(f store.Fork) *time.Time {
	if f.Phase != api.ForkRetrying || f.RetryAt == nil {
		return nil
	}
	at := f.RetryAt.UTC()
	return &at
}

// resumeFork runs the pass of one unfinished fork unless a request
// finished it meanwhile, it failed for good, or its retry is not due yet
// (checked under the fork's lock). A pass of this process that resumes the
// fork already (a round of the monitor before) is left to finish.
func (s *Service) resumeFork(ctx context.Context, id string) {
	if !s.forkResumes.begin(id) {
		return
	}
	defer s.forkResumes.end(id)
	unlock := s.forkLocks.lock(id)
	defer unlock()
	f, err := s.store.GetFork(ctx, id)
	if err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Warn("resume fork: read fork", "fork", id, "err", err)
		}
		return
	}
	if f.Phase == api.ForkReady || f.Phase == api.ForkFailed {
		return
	}
	if f.Phase == api.ForkRetrying && f.RetryAt != nil && f.RetryAt.After(time.Now()) {
		return
	}
	if _, err := s.forkPassLocked(ctx, id, false); err != nil {
		s.log.Warn("resume fork: pass failed", "fork", id, "err", err)
		return
	}
	s.log.Info("fork resumed", "fork", id)
}

// forkChildren returns a fork's child rows by slot.
func (s *Service) forkChildren(ctx context.Context, id string) ([]store.VM, error) {
	vms, err := s.store.ListVMs(ctx, store.VMFilter{ForkID: id})
	if err != nil {
		return nil, fromStore(err, "list children of fork "+id)
	}
	slices.SortFunc(vms, func(a, b store.VM) int { return cmp.Compare(slotOf(a), slotOf(b)) })
	return vms, nil
}

func slotOf(vm store.VM) int {
	if vm.ForkSlot == nil {
		return -1
	}
	return *vm.ForkSlot
}

func isCode(err error, code string) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == code
}

// keyedLocks serialises the passes of one fork within this process; the
// zero value is ready. Across replicas the idempotent agent calls and the
// unique child names keep concurrent passes from making a second anything.
type keyedLocks struct {
	mu    sync.Mutex
	locks map[string]*keyedLock
}

type keyedLock struct {
	mu   sync.Mutex
	refs int
}

func (k *keyedLocks) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyedLock{}
	}
	l, ok := k.locks[key]
	if !ok {
		l = &keyedLock{}
		k.locks[key] = l
	}
	l.refs++
	k.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		k.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}

func (p *agentPool) createSnapshot(ctx context.Context, c *agentapi.Client, id string, spec agentapi.SnapshotSpec) (agentapi.Snapshot, error) {
	var out agentapi.Snapshot
	err := p.call("create_snapshot", func() (err error) { out, err = c.CreateSnapshot(ctx, id, spec); return err })
	return out, err
}

func (p *agentPool) deleteSnapshot(ctx context.Context, c *agentapi.Client, id string) error {
	return p.call("delete_snapshot", func() error { return c.DeleteSnapshot(ctx, id) })
}
