package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// BenchmarkMetricsScrape measures a /metrics scrape on SQLite with
// KVM_BENCH_METRICS_VMS VM rows (default 100,000), and the latency of a
// one-row write (PATCH /v1/vms/{id} labels) while 8 scrapers scrape in a
// loop: the write shares SQLite's one connection with whatever a scrape
// does there.
//
//	go test ./bench -run '^$' -bench MetricsScrape -benchtime 20x
func BenchmarkMetricsScrape(b *testing.B) {
	defer machineState(b)()
	n := 100000
	if s := os.Getenv("KVM_BENCH_METRICS_VMS"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil {
			b.Fatal(err)
		}
	}
	c := testenv.StartControl(b, testenv.ControlOptions{NoMonitor: true})
	a := testenv.StartAgent(b, testenv.AgentOptions{VCPUs: 1 << 20, MemoryMiB: 1 << 40, DiskMiB: 1 << 40})
	c.RegisterHost(b, "h1", a.Address)
	ctx := context.Background()
	// Rows only (no agent VMs): the scrape cost depends on rows, not guests.
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := c.Store.ReserveAndInsertVM(ctx, store.VM{ID: fmt.Sprintf("vm-%07d", i), Name: fmt.Sprintf("vm-%07d", i),
				HostName: "h1", Image: "sim", PowerState: api.PowerRunning, ObservedState: api.StateRunning}); err != nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
	scrape := func() time.Duration {
		start := time.Now()
		resp, err := http.Get(c.URL + "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return time.Since(start)
	}
	var scrapes []time.Duration
	for b.Loop() {
		scrapes = append(scrapes, scrape())
	}
	// A one-row write while 8 scrapers run.
	stop := make(chan struct{})
	var scrapers sync.WaitGroup
	for range 8 {
		scrapers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					scrape()
				}
			}
		})
	}
	var writes []time.Duration
	for i := range 20 {
		labels := map[string]string{"n": strconv.Itoa(i)}
		start := time.Now()
		if _, err := c.Client.UpdateVM(ctx, "vm-0000000", api.VMPatch{Labels: &labels}); err != nil {
			b.Fatal(err)
		}
		writes = append(writes, time.Since(start))
	}
	close(stop)
	scrapers.Wait()
	b.ReportMetric(float64(median(scrapes).Microseconds())/1000, "scrape-p50-ms")
	b.ReportMetric(float64(median(writes).Microseconds())/1000, "write-p50-under-8-scrapers-ms")
	b.ReportMetric(float64(n), "vm-rows")
}
