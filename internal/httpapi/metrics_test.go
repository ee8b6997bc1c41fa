package httpapi_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestMetricsScrapeReadsNoDatabase: /metrics answers from memory. With the
// database closed a scrape still answers 200 with the VM counts, so no
// scrape can scan the VM table (or hold SQLite's one connection).
func TestMetricsScrapeReadsNoDatabase(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, name := range []string{"m1", "m2", "m3"} {
		if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, ""); err != nil {
			t.Fatal(err)
		}
	}
	c.Service.SyncNow(ctx)
	_ = c.Store.Close()
	for range 3 {
		r := send(t, c, "GET", "/metrics", "", nil, nil)
		if r.status != 200 || !bytes.Contains(r.body, []byte(`kvmd_vms{state="running"} 3`)) {
			t.Fatalf("/metrics with the database closed: %d\n%s", r.status, r.body)
		}
	}
}
