package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// BenchmarkAPILoad is a closed-loop load generator against the control
// API over loopback HTTP (control API and sim agents in this process):
// GET /v1/vms/{id} on 500 existing VMs and POST /v1/vms (each a placement,
// a reservation and a create on a sim agent), on SQLite and on PostgreSQL.
// Each case runs for KVM_BENCH_API_DURATION (default 10s) or until
// KVM_BENCH_API_MAX requests (default 200000), with 32 clients, and reports
// requests/s and p50/p99 latency:
//
//	KVM_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//	  go test ./bench -run '^$' -bench APILoad -benchtime 1x
func BenchmarkAPILoad(b *testing.B) {
	defer machineState(b)()
	for _, db := range []string{"sqlite", "postgres"} {
		for _, op := range []string{"get", "post"} {
			b.Run(db+"/"+op, func(b *testing.B) {
				url := ""
				if db == "postgres" {
					url = testenv.PostgresURL(b)
				}
				c := testenv.StartControl(b, testenv.ControlOptions{DatabaseURL: url})
				for i := range 8 {
					// Roomy hosts: no run fills them.
					a := testenv.StartAgent(b, testenv.AgentOptions{VCPUs: 1 << 20, MemoryMiB: 1 << 40, DiskMiB: 1 << 40})
					c.RegisterHost(b, fmt.Sprintf("host-%d", i), a.Address)
				}
				var ids []string
				if op == "get" {
					ids = createForGets(b, c, 500)
				}
				for b.Loop() {
					apiLoad(b, c, op, ids)
				}
			})
		}
	}
}

const apiLoadClients = 32

// createForGets creates n VMs, 32 at a time, for the GET load.
func createForGets(b *testing.B, c *testenv.Control, n int) []string {
	ids := make([]string, n)
	sem := make(chan struct{}, apiLoadClients)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			vm, err := c.Client.CreateVM(context.Background(), api.VMCreate{Name: fmt.Sprintf("get-%d", i),
				Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
			if err != nil {
				b.Error(err)
				return
			}
			ids[i] = vm.ID
		})
	}
	wg.Wait()
	if b.Failed() {
		b.FailNow()
	}
	return ids
}

func apiLoad(b *testing.B, c *testenv.Control, op string, ids []string) {
	ctx := context.Background()
	duration := 10 * time.Second
	if v := os.Getenv("KVM_BENCH_API_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			b.Fatalf("KVM_BENCH_API_DURATION: %v", err)
		}
		duration = d
	}
	maxRequests := int64(200000)
	if v := os.Getenv("KVM_BENCH_API_MAX"); v != "" {
		if _, err := fmt.Sscan(v, &maxRequests); err != nil {
			b.Fatalf("KVM_BENCH_API_MAX: %v", err)
		}
	}
	// One HTTP client per worker, no retries: a failure is counted, not hidden.
	clients := make([]*client.Client, apiLoadClients)
	for i := range clients {
		clients[i] = client.New(c.URL, c.Token, client.WithRetries(0, 0))
	}
	run := time.Now().UnixNano()
	var issued, failed atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	deadline := time.Now().Add(duration)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range apiLoadClients {
		wg.Go(func() {
			cl := clients[w]
			mine := make([]time.Duration, 0, 4096)
			for time.Now().Before(deadline) {
				n := issued.Add(1)
				if n > maxRequests {
					break
				}
				t0 := time.Now()
				var err error
				if op == "get" {
					_, err = cl.GetVM(ctx, ids[int(n)%len(ids)])
				} else {
					_, err = cl.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("load-%d-%d", run, n), Image: "sim",
						VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
				}
				if err != nil {
					failed.Add(1)
					continue
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d of %d requests failed", n, int64(len(lat))+n)
	}
	slices.Sort(lat)
	q := func(p int) float64 { return float64(lat[(len(lat)-1)*p/100].Microseconds()) / 1000 }
	rps := float64(len(lat)) / elapsed.Seconds()
	b.ReportMetric(rps, "req/s")
	b.ReportMetric(q(50), "p50-ms")
	b.ReportMetric(q(99), "p99-ms")
	b.ReportMetric(float64(len(lat)), "requests")
	fmt.Printf("api load %s: %d requests in %v with %d clients: %.0f req/s, p50 %.2f ms, p99 %.2f ms\n",
		b.Name(), len(lat), elapsed.Round(time.Millisecond), apiLoadClients, rps, q(50), q(99))
}
