package control

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// drainParallel bounds the migrations a drain runs at once: each moves a
// VM's memory and disk between two agents, and a host that drains should
// stay usable for the VMs still on it.
const drainParallel = 2

// drains are the drain passes this replica runs, by host.
type drains struct {
	mu      sync.Mutex
	running map[string]bool
	kick    chan struct{}
}

func newDrains() drains {
	return drains{running: map[string]bool{}, kick: make(chan struct{}, 1)}
}

// DrainHost marks host name draining (POST /v1/hosts/{name}/drain): no new
// VM goes there, and the host monitor migrates its VMs off it, drainParallel
// at a time, each to a host its own constraints allow. It answers at once;
// GET /v1/hosts/{name} shows the progress. Draining the last host that
// could take VMs is refused.
func (s *Service) DrainHost(ctx context.Context, name string) (api.Host, error) {
	h, err := s.store.GetHost(ctx, name)
	if err != nil {
		return api.Host{}, fromStore(err, "read host "+name)
	}
	if h.RetiredAt != nil {
		return api.Host{}, conflictf("host %s is retired: it has no VMs to move", name)
	}
	n, err := s.store.CountVMsOnHost(ctx, name)
	if err != nil {
		return api.Host{}, fromStore(err, "count vms of host "+name)
	}
	h, err = s.store.StartDrain(ctx, name, s.replicaID, n)
	if errors.Is(err, store.ErrLastHost) {
		return api.Host{}, &Error{Code: api.CodeConflict, Details: map[string]any{"host": name, "reason": "last_host"},
			Message: fmt.Sprintf("host %s is the last host that is alive, schedulable and not draining: its VMs would have nowhere to go; "+
				"register or undrain another host first", name)}
	}
	if err != nil {
		return api.Host{}, fromStore(err, "drain host "+name)
	}
	s.refreshHost(ctx, name)
	s.log.Info("host drain started", "host", name, "vms", n)
	select {
	case s.drains.kick <- struct{}{}:
	default:
	}
	return s.GetHost(ctx, name)
}

// UndrainHost puts host name back in service (POST
// /v1/hosts/{name}/undrain): it takes VMs again, and a drain pass that runs
// stops before its next migration (those under way finish).
func (s *Service) UndrainHost(ctx context.Context, name string) (api.Host, error) {
	if _, err := s.store.Undrain(ctx, name); err != nil {
		return api.Host{}, fromStore(err, "undrain host "+name)
	}
	s.refreshHost(ctx, name)
	s.log.Info("host undrained", "host", name)
	return s.GetHost(ctx, name)
}

// resumeDrains starts, in the background, the pass of every draining host
// that this replica owns and does not run (a drain just asked for, or one
// left by this replica's previous life) or whose owner's lease lapsed (it
// is taken over first).
func (s *Service) resumeDrains(ctx context.Context, l leases, run func(func())) {
	hosts, err := s.store.AllHosts(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("host monitor: list hosts for drains", "err", err)
		}
		return
	}
	for _, h := range hosts {
		if h.Drain.State != store.DrainDraining {
			continue
		}
		owner := h.Drain.Owner
		if owner == nil || *owner != s.replicaID {
			if !l.lapsed(owner) && owner != nil {
				continue
			}
			took, err := s.store.TakeDrain(ctx, h.Name, owner, s.replicaID)
			if err != nil {
				s.log.Error("host monitor: take over drain", "host", h.Name, "err", err)
				continue
			}
			if !took {
				continue
			}
			s.log.Warn("host drain left by a replica that is gone; resuming it here", "host", h.Name)
		}
		s.drains.mu.Lock()
		busy := s.drains.running[h.Name]
		s.drains.running[h.Name] = true
		s.drains.mu.Unlock()
		if busy {
			continue
		}
		run(func() {
			defer func() {
				s.drains.mu.Lock()
				delete(s.drains.running, h.Name)
				s.drains.mu.Unlock()
			}()
			s.runDrain(ctx, h.Name)
		})
	}
}

// runDrain migrates host name's VMs off it until none is left (drained),
// or every VM left failed to move in this pass (incomplete), or the drain
// was undone or taken over.
func (s *Service) runDrain(ctx context.Context, name string) {
	log := s.log.With("host", name)
	tried := map[string]bool{}
	for ctx.Err() == nil {
		h, err := s.store.GetHost(ctx, name)
		if err != nil {
			log.Error("drain: read host", "err", err)
			return
		}
		if h.Drain.State != store.DrainDraining || h.Drain.Owner == nil || *h.Drain.Owner != s.replicaID {
			return
		}
		vms, err := s.store.ListVMs(ctx, store.VMFilter{Host: name})
		if err != nil {
			log.Error("drain: list vms", "err", err)
			return
		}
		var todo []store.VM
		left := 0
		for _, vm := range vms {
			if !vm.HoldsCapacity {
				continue
			}
			left++
			if !tried[vm.ID] {
				todo = append(todo, vm)
			}
		}
		// Moved counts the VMs that left since the drain started, however
		// they left (a migration the monitor finished after a crash too).
		movedSoFar := max(0, h.Drain.Total-int64(left))
		if left == 0 {
			if _, err := s.store.SetDrainProgress(ctx, name, s.replicaID, store.DrainDrained, movedSoFar, h.Drain.Failed); err != nil {
				log.Error("drain: record drained", "err", err)
			}
			log.Info("host drained")
			return
		}
		if len(todo) == 0 {
			if _, err := s.store.SetDrainProgress(ctx, name, s.replicaID, store.DrainIncomplete, movedSoFar, h.Drain.Failed); err != nil {
				log.Error("drain: record incomplete", "err", err)
			}
			log.Warn("host drain incomplete: some vms could not move", "left", left, "failed", h.Drain.Failed)
			return
		}
		todo = todo[:min(len(todo), drainParallel)]
		type outcome struct {
			vm     string
			target string
			err    error
		}
		out := make([]outcome, len(todo))
		var wg sync.WaitGroup
		for i, vm := range todo {
			tried[vm.ID] = true
			wg.Go(func() {
				mctx, cancel := detached(ctx, migrateTimeout)
				defer cancel()
				target, err := s.migrateOnce(mctx, vm, "", name)
				out[i] = outcome{vm: vm.ID, target: target, err: err}
			})
		}
		wg.Wait()
		moved, failed := movedSoFar, slices.Clone(h.Drain.Failed)
		for _, o := range out {
			failed = slices.DeleteFunc(failed, func(f store.DrainFailure) bool { return f.VM == o.vm })
			if o.err != nil {
				if errors.Is(o.err, errMigrationStopped) {
					return // a test hook stopped it: as if this process died
				}
				failed = append(failed, store.DrainFailure{VM: o.vm, Reason: o.err.Error()})
				log.Warn("drain: vm could not move", "vm", o.vm, "err", o.err)
				continue
			}
			moved++
		}
		ok, err := s.store.SetDrainProgress(ctx, name, s.replicaID, store.DrainDraining, moved, failed)
		if err != nil {
			log.Error("drain: record progress", "err", err)
			return
		}
		if !ok {
			return // undrained, or another replica runs it now
		}
	}
}

// apiDrain is the wire form of a host's drain; remaining is how many VMs
// hold capacity on it now.
func apiDrain(d store.Drain, remaining int64) api.HostDrain {
	out := api.HostDrain{State: d.State, Total: d.Total, Moved: d.Moved, Remaining: remaining, Failed: []api.DrainFailure{}}
	for _, f := range d.Failed {
		out.Failed = append(out.Failed, api.DrainFailure{VM: f.VM, Reason: f.Reason})
	}
	return out
}
