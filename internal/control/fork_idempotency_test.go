package control_test

import (
	"errors"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// An Idempotency-Key names one request. After a fork's pass fails the key
// is free for a retry of that request, but the same key with another body
// is 422 idempotency_mismatch: it neither resumes the old fork nor makes a
// new one; the same body still resumes the old fork.
func TestForkKeyReuseWithAnotherBodyAfterAFailedPass(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		injected := errors.New("injected database failure")
		e := startForkEnv(t, dbURL, 3072, &control.Hooks{ForkStep: once(control.ForkStepChildReserve, 1, injected)})
		in := api.ForkCreate{SourceVMID: e.source.ID, Count: 3}
		key := client.NewIdempotencyKey()
		_, err := noRetry(e.c).CreateFork(ctx, in, key)
		if err == nil {
			t.Fatal("fork with an injected failure succeeded")
		}
		id := forkErrorID(t, err)
		before, err := e.c.Client.GetFork(ctx, id)
		if err != nil {
			t.Fatal(err)
		}

		for _, other := range []api.ForkCreate{
			{SourceVMID: e.source.ID, Count: 1},
			{SourceVMID: e.source.ID, Count: 3, Placement: api.PlacementSpread},
			{SourceVMID: e.source.ID, Count: 3, PauseSource: true},
		} {
			f, err := noRetry(e.c).CreateFork(ctx, other, key)
			if apiCode(err) != api.CodeIdempotencyMismatch {
				t.Errorf("same key, body %+v: fork %s phase %s, err %v; want %s", other, f.ID, f.Phase, err, api.CodeIdempotencyMismatch)
			}
		}
		after, err := e.c.Client.GetFork(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if after.Phase != before.Phase || len(after.Children) != len(before.Children) || after.Count != before.Count {
			t.Errorf("the refused requests changed fork %s: phase %s -> %s, children %d -> %d, count %d -> %d", id,
				before.Phase, after.Phase, len(before.Children), len(after.Children), before.Count, after.Count)
		}
		forks := map[string]bool{}
		vms, err := e.c.Client.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, vm := range vms {
			if vm.ForkID != "" {
				forks[vm.ForkID] = true
			}
		}
		if len(forks) > 1 {
			t.Errorf("children of %d forks exist, want only fork %s's", len(forks), id)
		}

		f, err := noRetry(e.c).CreateFork(ctx, in, key)
		if err != nil {
			t.Fatalf("retry with the same body: %v", err)
		}
		if f.ID != id {
			t.Errorf("retry with the same body made fork %s, want %s resumed", f.ID, id)
		}
		e.checkFork(t, id, 3)
	})
}

// A retry that meets 409 in_flight on its own key learns the fork's id
// (details.fork_id) once the first request has recorded it, so that a
// client that must give up waiting can keep track of the fork and delete
// it later (the provider saves it as tainted).
func TestForkInFlightNamesTheFork(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ag := testenv.StartSlowAgent(t, testenv.AgentOptions{}, 3*time.Second)
	ag.Slow.Store(false)
	c.RegisterHost(t, "h1", ag.Address)
	src, err := c.Client.CreateVM(ctx, smallVM("src"), "")
	if err != nil {
		t.Fatal(err)
	}
	ag.Slow.Store(true) // the children's starts are slow
	key := client.NewIdempotencyKey()
	in := api.ForkCreate{SourceVMID: src.ID, Count: 1}
	// Two requests with the same key race; whichever claims it runs the
	// fork, the other meets 409 in_flight (retried until it does).
	named := func(err error) string {
		var ce *client.Error
		if apiCode(err) != api.CodeInFlight || !errors.As(err, &ce) {
			return ""
		}
		id, _ := ce.Details["fork_id"].(string)
		return id
	}
	results := make(chan error, 2)
	for range 2 {
		go func() {
			for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				_, err := noRetry(c).CreateFork(ctx, in, key)
				if apiCode(err) != api.CodeInFlight || named(err) != "" {
					results <- err
					return
				}
			}
			results <- errors.New("gave up")
		}()
	}
	var forkID string
	for range 2 {
		err := <-results
		if id := named(err); id != "" {
			forkID = id
		} else if err != nil {
			t.Errorf("create: %v", err)
		}
	}
	if forkID == "" {
		t.Fatal("no 409 in_flight named the fork while its first request ran")
	}
	if _, err := c.Client.GetFork(ctx, forkID); err != nil {
		t.Errorf("the fork named by in_flight: %v", err)
	}
}
