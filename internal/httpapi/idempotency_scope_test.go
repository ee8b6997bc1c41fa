package httpapi_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestIdempotencyKeysAreScopedByCaller: an Idempotency-Key belongs to the
// token that sent it. Two tokens (and the bootstrap token) using the same
// key with different bodies each get their own VM and fork; neither
// replays nor blocks the other's; each still replays its own. On SQLite
// and on PostgreSQL.
func TestIdempotencyKeysAreScopedByCaller(t *testing.T) {
	for _, db := range []string{store.DialectSQLite, store.DialectPostgres} {
		t.Run(db, func(t *testing.T) {
			opts := testenv.ControlOptions{}
			if db == store.DialectPostgres {
				opts.DatabaseURL = testenv.PostgresURL(t)
			}
			c := testenv.StartControl(t, opts)
			c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			callers := map[string]*client.Client{"bootstrap": client.New(c.URL, c.Token, client.WithRetries(0, 0))}
			for _, name := range []string{"alice", "bob"} {
				tok, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: name, Scopes: []string{"user"}})
				if err != nil {
					t.Fatal(err)
				}
				callers[name] = client.New(c.URL, tok.Secret, client.WithRetries(0, 0))
			}
			const vmKey, forkKey = "shared-vm-key", "shared-fork-key"
			vms := map[string]api.VM{}
			forks := map[string]api.Fork{}
			for _, name := range []string{"alice", "bob", "bootstrap"} {
				in := api.VMCreate{Name: name + "-vm", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}
				vm, err := callers[name].CreateVM(ctx, in, vmKey)
				if err != nil {
					t.Fatalf("%s creating VM %s with Idempotency-Key %s, which other callers used: %v; want its own VM", name, in.Name, vmKey, err)
				}
				if vm.Name != in.Name {
					t.Fatalf("%s creating VM %s with Idempotency-Key %s got VM %s (%s): another caller's response replayed", name, in.Name, vmKey, vm.Name, vm.ID)
				}
				vms[name] = vm
				f, err := callers[name].CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 1}, forkKey)
				if err != nil {
					t.Fatalf("%s forking its VM %s with Idempotency-Key %s, which other callers used: %v; want its own fork", name, vm.ID, forkKey, err)
				}
				if f.SourceVMID != vm.ID {
					t.Fatalf("%s forking VM %s got fork %s of VM %s: another caller's fork", name, vm.ID, f.ID, f.SourceVMID)
				}
				forks[name] = f
			}
			// The same caller, key and body replays.
			for name, cl := range callers {
				vm, err := cl.CreateVM(ctx, api.VMCreate{Name: name + "-vm", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, vmKey)
				if err != nil || vm.ID != vms[name].ID {
					t.Errorf("%s retrying its create with its key: VM %s, %v; want the replay of VM %s", name, vm.ID, err, vms[name].ID)
				}
				f, err := cl.CreateFork(ctx, api.ForkCreate{SourceVMID: vms[name].ID, Count: 1}, forkKey)
				if err != nil || f.ID != forks[name].ID {
					t.Errorf("%s retrying its fork with its key: fork %s, %v; want fork %s again", name, f.ID, err, forks[name].ID)
				}
			}
			all, err := c.Client.AllVMs(ctx, client.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(all) != 6 { // three VMs and one child each
				t.Errorf("%d VMs after three callers' creates and forks and their retries; want 6", len(all))
			}
		})
	}
}
