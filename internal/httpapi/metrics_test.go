package httpapi_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpapi"
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
	before := c.Store.Statements()
	for range 5 {
		if r := send(t, c, "GET", "/metrics", "", nil, nil); r.status != 200 {
			t.Fatalf("/metrics: %d %s", r.status, r.body)
		}
	}
	if n := c.Store.Statements() - before; n != 0 {
		t.Errorf("5 scrapes issued %d SQL statements; want none", n)
	}
	_ = c.Store.Close()
	for range 3 {
		r := send(t, c, "GET", "/metrics", "", nil, nil)
		if r.status != 200 || !bytes.Contains(r.body, []byte(`kvmd_vms{state="running"} 3`)) {
			t.Fatalf("/metrics with the database closed: %d\n%s", r.status, r.body)
		}
	}
}

// TestMetricsToken: with a metrics token set, /metrics answers only to it
// (not to API tokens, which are for /v1); without one it stays open.
func TestMetricsToken(t *testing.T) {
	guarded := newFuzzControl(t, func(o *httpapi.Options) { o.MetricsToken = "scrape-secret" })
	for auth, want := range map[string]int{
		"":                       401,
		"Bearer wrong":           401,
		"Bearer " + fuzzToken:    401,
		"scrape-secret":          401,
		"Bearer scrape-secret":   200,
		"Bearer scrape-secretx":  401,
		"Bearer scrape-secre":    401,
		"bearer scrape-secret":   401,
		"Basic scrape-secret":    401,
		"Bearer  scrape-secret ": 401,
	} {
		rec := callRec(guarded.handler, http.MethodGet, "/metrics", auth)
		if rec.Code != want {
			t.Errorf("/metrics with Authorization %q: %d; want %d", auth, rec.Code, want)
		}
		if want == 200 && !strings.Contains(rec.Body.String(), "kvmd_vms{") {
			t.Errorf("/metrics with the metrics token lacks kvmd_vms: %s", trim(rec.Body.String()))
		}
	}
	open := newFuzzControl(t)
	if code := call(open.handler, http.MethodGet, "/metrics", ""); code != 200 {
		t.Errorf("/metrics without a metrics token configured: %d; want 200 (open)", code)
	}
}
