package control_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const forkRetryNoRoomReason = "injected: no host has room for the child"

// forkRetryNoRoom returns a ForkStep hook that refuses every reservation of
// a child (no child ever exists) and counts the passes that got there.
func forkRetryNoRoom(passes *atomic.Int64) func(context.Context, string, string, int) error {
	return func(_ context.Context, _ string, step string, slot int) error {
		if step == control.ForkStepChildReserve && slot == 0 {
			passes.Add(1)
			return errors.New(forkRetryNoRoomReason)
		}
		return nil
	}
}

// A fork whose pass fails every time and that has no children is retried by
// the host monitor a bounded number of times (api.MaxForkAttempts passes in
// all, with a backoff), then stays failed with its reason: replica restarts
// (each resumes unfinished forks at start-up) do not run it again, and a
// PATCH (a user's request) runs it again with a fresh count.
func TestForkFailedPassRetriesBoundedThenStaysFailed(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		var passes atomic.Int64
		hooks := &control.Hooks{ForkStep: forkRetryNoRoom(&passes)}
		e := startForkEnv(t, dbURL, 3072, hooks)
		start := func() {
			e.c.Stop()
			e.c = testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: e.dbURL, DataDir: e.dataDir, Hooks: hooks,
				ForkRetryBackoff: 20 * time.Millisecond})
		}
		start()
		_, err := noRetry(e.c).CreateFork(ctx, api.ForkCreate{SourceVMID: e.source.ID, Count: 2}, client.NewIdempotencyKey())
		if err == nil {
			t.Fatal("a fork whose children can never be reserved succeeded")
		}
		id := forkErrorID(t, err)
		var f api.Fork
		eventually(t, "the host monitor retries the fork until it is failed for good", func() bool {
			f, err = e.c.Client.GetFork(ctx, id)
			return err == nil && f.Phase == api.ForkFailed
		})
		if f.Attempts != api.MaxForkAttempts || f.RetryAt != nil || !strings.Contains(f.Error, forkRetryNoRoomReason) || len(f.Children) != 0 {
			t.Errorf("failed fork: attempts %d, retry_at %v, error %q, %d children; want %d attempts, no retry, the reason, no child",
				f.Attempts, f.RetryAt, f.Error, len(f.Children), api.MaxForkAttempts)
		}
		for range 5 {
			start()
			// What the restart's monitor runs at start-up, run here too so
			// that each restart surely had its turn.
			e.c.Service.ResumeForks(ctx, time.Now().Add(time.Minute))
		}
		if n := passes.Load(); n != api.MaxForkAttempts {
			t.Fatalf("the fork's pass ran %d times over 5 restarts, want exactly %d", n, api.MaxForkAttempts)
		}
		// A user's PATCH runs it again, counting afresh.
		count := 2
		if _, err := noRetry(e.c).UpdateFork(ctx, id, api.ForkPatch{Count: &count}); err == nil {
			t.Fatal("PATCH of a fork that can never reserve a child succeeded")
		}
		if f, err = e.c.Client.GetFork(ctx, id); err != nil {
			t.Fatal(err)
		}
		if passes.Load() < api.MaxForkAttempts+1 || f.Attempts < 1 || f.Attempts > api.MaxForkAttempts {
			t.Errorf("after a PATCH: %d passes, attempts %d; want the PATCH's pass to run and count from 1", passes.Load(), f.Attempts)
		}
		checkLedger(t, e.c.Store)
	})
}
