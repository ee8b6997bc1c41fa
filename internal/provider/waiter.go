package provider

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// pollInterval is how long a waiter waits before its first refresh; the wait
// doubles up to maxPollInterval.
const (
	pollInterval    = 100 * time.Millisecond
	maxPollInterval = 2 * time.Second
)

// stateGone is the state a refresh reports for an object the control API
// does not know (a confirmed 404).
const stateGone = "gone"

// stateChange waits for an object to reach one of the Target states, the idea
// of the AWS provider's retry.StateChangeConf, typed: Refresh reads the object
// and names its state; a Pending state keeps waiting; any other state ends the
// wait with Unexpected's error. The wait between refreshes starts at
// pollInterval and doubles up to maxPollInterval (MaxInterval overrides it);
// ctx bounds the whole wait and the end of ctx ends it with TimedOut's error.
//
// Written here rather than taken from terraform-plugin-sdk/v2's helper/retry
// because that one is untyped (interface{} results), runs each refresh in a
// goroutine of its own, and backs off up to 10 s, which would make a waiting
// apply up to 10 s later than the guest.
type stateChange[T any] struct {
	Pending []string
	Target  []string
	// Refresh reads the object and names its state. An error ends the wait
	// (the client has already retried what can be retried).
	Refresh func(ctx context.Context) (T, string, error)
	// Unexpected explains an object in a state neither pending nor target.
	Unexpected func(obj T, state string) error
	// TimedOut explains an object still pending when ctx ended (err is
	// ctx's error, to wrap).
	TimedOut func(obj T, state string, err error) error
	// MaxInterval caps the wait between refreshes (0: maxPollInterval).
	MaxInterval time.Duration
}

// wait refreshes the object until it reaches a target state.
func (c stateChange[T]) wait(ctx context.Context) (T, error) {
	obj, state, err := c.Refresh(ctx)
	if err != nil {
		return obj, err
	}
	return c.waitFrom(ctx, obj, state)
}

// waitFrom is wait for an object already in hand (a create's answer), so
// that an object already in a target state costs no read.
func (c stateChange[T]) waitFrom(ctx context.Context, obj T, state string) (T, error) {
	limit := c.MaxInterval
	if limit <= 0 {
		limit = maxPollInterval
	}
	interval := min(pollInterval, limit)
	for {
		switch {
		case slices.Contains(c.Target, state):
			return obj, nil
		case !slices.Contains(c.Pending, state):
			if c.Unexpected == nil {
				return obj, fmt.Errorf("unexpected state %q", state)
			}
			return obj, c.Unexpected(obj, state)
		}
		if err := ctx.Err(); err != nil {
			return obj, c.TimedOut(obj, state, err)
		}
		timer := time.NewTimer(interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return obj, c.TimedOut(obj, state, ctx.Err())
		case <-timer.C:
		}
		interval = min(2*interval, limit)
		next, nextState, err := c.Refresh(ctx)
		if err != nil {
			if ctx.Err() != nil {
				// The deadline passed during the read: report what was
				// last seen, as a timeout, not as a failed read.
				return obj, c.TimedOut(obj, state, errors.Join(ctx.Err(), err))
			}
			return obj, err
		}
		obj, state = next, nextState
	}
}

// vmStates is every state a VM can report, "" (not observed yet) included.
var vmStates = []string{"", api.StateCreating, api.StateRunning, api.StatePaused, api.StateStopped,
	api.StateUnknown, api.StateError, api.StateMissing, api.StateLost}

// statesExcept is states without the given ones.
func statesExcept(states []string, except ...string) []string {
	return slices.DeleteFunc(slices.Clone(states), func(s string) bool { return slices.Contains(except, s) })
}

// waitForPower reads the VM until the host observes the wanted power state,
// the VM fails, or ctx ends. The control API answers a create or power change
// once the agent has acted, so this usually returns at once.
func waitForPower(ctx context.Context, c *client.Client, vm api.VM, want string) (api.VM, error) {
	id := vm.ID
	return stateChange[api.VM]{
		Pending: statesExcept(vmStates, want, api.StateError, api.StateMissing, api.StateLost),
		Target:  []string{want},
		Refresh: func(ctx context.Context) (api.VM, string, error) {
			next, err := c.GetVM(ctx, id)
			if err != nil {
				return next, "", fmt.Errorf("reading VM %s: %w", id, err)
			}
			return next, next.ObservedState, nil
		},
		Unexpected: func(vm api.VM, state string) error {
			reason := vm.Reason
			if reason == "" {
				reason = "no reason given"
			}
			return fmt.Errorf("host %s reports it %s (%s)", vm.Host, state, reason)
		},
		TimedOut: func(_ api.VM, state string, err error) error {
			return fmt.Errorf("still %q when the timeout ended: %w", state, err)
		},
	}.waitFrom(ctx, vm, vm.ObservedState)
}

// waitForGone reads the VM until the control API says it does not exist.
func waitForGone(ctx context.Context, c *client.Client, id string) error {
	_, err := waitGone(ctx, "VM", id, func(ctx context.Context) error {
		_, err := c.GetVM(ctx, id)
		return err
	})
	return err
}

// waitForFork reads the fork until its pass is ready, it failed, or ctx
// ends. The control API may answer a create or a count change before the
// children run; the phase says when they do.
func waitForFork(ctx context.Context, c *client.Client, f api.Fork) (api.Fork, error) {
	id := f.ID
	return stateChange[api.Fork]{
		Pending: []string{"", api.ForkPending, api.ForkSnapshotting, api.ForkSpawning},
		Target:  []string{api.ForkReady},
		Refresh: func(ctx context.Context) (api.Fork, string, error) {
			next, err := c.GetFork(ctx, id)
			if err != nil {
				return next, "", fmt.Errorf("reading fork %s: %w", id, err)
			}
			return next, next.Phase, nil
		},
		Unexpected: func(f api.Fork, phase string) error {
			reason := f.Error
			if reason == "" {
				reason = "no error given"
			}
			switch phase {
			case api.ForkFailed:
				reason = fmt.Sprintf("%s; it failed %d passes in a row and the control API does not retry it any more", reason, f.Attempts)
			case api.ForkRetrying:
				reason = fmt.Sprintf("%s; the control API retries it by itself (attempt %d of %d failed)", reason, f.Attempts, api.MaxForkAttempts)
			default:
				reason = fmt.Sprintf("phase %q: %s", phase, reason)
			}
			return fmt.Errorf("the control API reports it failed (%s); %d of %d children exist", reason, len(f.Children), f.Count)
		},
		TimedOut: func(f api.Fork, phase string, err error) error {
			return fmt.Errorf("still %q with %d of %d children when the timeout ended: %w", phase, len(f.Children), f.Count, err)
		},
	}.waitFrom(ctx, f, f.Phase)
}

// waitForForkGone reads the fork until the control API says it does not exist.
func waitForForkGone(ctx context.Context, c *client.Client, id string) error {
	_, err := waitGone(ctx, "fork", id, func(ctx context.Context) error {
		_, err := c.GetFork(ctx, id)
		return err
	})
	return err
}

// waitGone reads an object (get returns its read's error) until the control
// API answers that it does not exist.
func waitGone(ctx context.Context, kind, id string, get func(context.Context) error) (struct{}, error) {
	const exists = "exists"
	return stateChange[struct{}]{
		Pending: []string{exists},
		Target:  []string{stateGone},
		Refresh: func(ctx context.Context) (struct{}, string, error) {
			err := get(ctx)
			switch {
			case errors.Is(err, client.ErrNotFound):
				return struct{}{}, stateGone, nil
			case err != nil:
				return struct{}{}, "", fmt.Errorf("checking that %s %s is gone: %w", kind, id, err)
			}
			return struct{}{}, exists, nil
		},
		TimedOut: func(_ struct{}, _ string, err error) error {
			return fmt.Errorf("%s %s still exists when the delete timeout ended: %w", kind, id, err)
		},
	}.wait(ctx)
}
