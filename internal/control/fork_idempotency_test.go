package control_test

import (
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
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
