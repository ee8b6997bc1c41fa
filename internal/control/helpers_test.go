package control_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// eachDatabase runs a test on SQLite and on PostgreSQL. fn gets the
// database URL to give StartControl ("" = SQLite).
func eachDatabase(t *testing.T, fn func(t *testing.T, databaseURL string)) {
	t.Run("sqlite", func(t *testing.T) { fn(t, "") })
	t.Run("postgres", func(t *testing.T) { fn(t, testenv.PostgresURL(t)) })
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond until it holds; it fails the test after a generous
// deadline. It waits for asynchronous work and asserts no timing.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func smallVM(name string) api.VMCreate {
	return api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}
}

func apiCode(err error) string {
	var e *client.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

// checkLedger asserts that no host is over capacity and that each host's
// allocation equals the sum of the VM and volume rows that hold capacity
// on it.
func checkLedger(t *testing.T, st *store.Store) {
	t.Helper()
	ctx := context.Background()
	hosts, err := st.AllHosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	vms, err := st.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	sum := map[string]store.Resources{}
	for _, vm := range vms {
		if vm.HoldsCapacity {
			s := sum[vm.HostName]
			s.VCPUs += vm.Resources.VCPUs
			s.MemoryMiB += vm.Resources.MemoryMiB
			s.DiskMiB += vm.Resources.DiskMiB
			sum[vm.HostName] = s
		}
	}
	vols, err := st.ListVolumes(ctx, store.VolumeFilter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vols {
		if v.HoldsCapacity {
			s := sum[v.HostName]
			s.DiskMiB += v.SizeMiB
			sum[v.HostName] = s
		}
		// A moving volume holds its size on the other host of its move too.
		for _, other := range []*string{v.MoveTarget, v.MoveSource} {
			if other != nil {
				s := sum[*other]
				s.DiskMiB += v.SizeMiB
				sum[*other] = s
			}
		}
	}
	for _, h := range hosts {
		a, c := h.Allocated, h.Capacity
		if a.VCPUs > c.VCPUs || a.MemoryMiB > c.MemoryMiB || a.DiskMiB > c.DiskMiB {
			t.Errorf("host %s is over capacity: allocated %+v, capacity %+v", h.Name, a, c)
		}
		if a != sum[h.Name] {
			t.Errorf("host %s: allocated %+v but its VM and volume rows add up to %+v", h.Name, a, sum[h.Name])
		}
	}
}

func hostAllocated(t *testing.T, c *testenv.Control, name string) api.Resources {
	t.Helper()
	h, err := c.Client.GetHost(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return h.Allocated
}

// noRetry is a client that reports the first answer: failure tests must
// see the error of one create, not the outcome of the client's retries.
func noRetry(c *testenv.Control) *client.Client {
	return client.New(c.URL, c.Token, client.WithRetries(0, 0))
}
