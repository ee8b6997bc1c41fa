package control_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func TestIdempotencyKeyReplaysAndRefuses(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)

		first, err := c.Client.CreateVM(ctx, smallVM("once"), "key-1")
		if err != nil {
			t.Fatal(err)
		}
		again, err := c.Client.CreateVM(ctx, smallVM("once"), "key-1")
		if err != nil || again.ID != first.ID {
			t.Fatalf("replay: %+v %v, want the first VM %s", again, err, first.ID)
		}
		other := smallVM("once")
		other.VCPUs = 2
		_, err = c.Client.CreateVM(ctx, other, "key-1")
		var e *client.Error
		if !errors.Is(err, client.ErrIdempotencyMismatch) || !errors.As(err, &e) || e.Status != 422 {
			t.Fatalf("same key, different body: %v, want 422", err)
		}
		if vms, _ := c.Client.AllVMs(ctx, client.ListOptions{}); len(vms) != 1 {
			t.Errorf("%d VMs, want 1", len(vms))
		}
		checkLedger(t, c.Store)
	})
}

func TestConcurrentRetriesWithOneKeyMakeOneVM(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		replicas := []*testenv.Control{c}
		if dbURL != "" {
			replicas = append(replicas, testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL}))
		}
		c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)

		var mu sync.Mutex
		ids := map[string]int{}
		var wg sync.WaitGroup
		for i := range 50 {
			r := replicas[i%len(replicas)]
			wg.Go(func() {
				vm, err := r.Client.CreateVM(ctx, smallVM("contended"), "one-key")
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					ids[vm.ID]++
				case errors.Is(err, client.ErrInFlight):
					// The client gave up retrying while the first ran: allowed.
				default:
					t.Errorf("retry %d: %v", i, err)
				}
			})
		}
		wg.Wait()
		if len(ids) != 1 {
			t.Errorf("successful retries returned %d different VMs: %v", len(ids), ids)
		}
		vms, _ := c.Client.AllVMs(ctx, client.ListOptions{})
		if len(vms) != 1 {
			t.Errorf("%d VMs exist, want exactly 1", len(vms))
		}
		checkLedger(t, c.Store)
	})
}
