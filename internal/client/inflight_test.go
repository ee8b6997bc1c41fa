package client_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A create slower than one attempt's timeout: the server keeps going, the
// retries with the same Idempotency-Key meet 409 in_flight. The client
// waits that out (polling within the caller's deadline, not a fixed number
// of retries) and returns the VM the first attempt made, once.
func TestCreateWaitsOutInFlightOnItsOwnKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ag := testenv.StartSlowAgent(t, testenv.AgentOptions{}, 3*time.Second)
	c.RegisterHost(t, "h1", ag.Address)
	// Each attempt gives up after 200 ms; four retries from 50 ms add up
	// to well under the create's 3 s.
	cl := client.New(c.URL, c.Token, client.WithTimeout(200*time.Millisecond), client.WithRetries(4, 50*time.Millisecond))
	vm, err := cl.CreateVM(ctx, api.VMCreate{Name: "slow", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 512}, client.NewIdempotencyKey())
	if err != nil {
		t.Fatalf("create slower than one attempt: %v; want the client to wait out in_flight on its own key", err)
	}
	if vm.Name != "slow" || vm.ObservedState != api.StateRunning {
		t.Errorf("created %+v, want VM slow running", vm)
	}
	all, err := c.Client.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[0].ID != vm.ID {
		t.Errorf("%d VMs exist, want exactly the one returned (%s)", len(all), vm.ID)
	}
}
