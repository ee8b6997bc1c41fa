package provider_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// accPreCheck skips acceptance tests unless TF_ACC is set, before any
// control API or agent is started for them.
func accPreCheck(t *testing.T) {
	t.Helper()
	if os.Getenv("TF_ACC") == "" {
		t.Skip("acceptance test: set TF_ACC=1 (make testacc) to run it with the terraform CLI")
	}
}

// fleet is an in-process control API with sim agents registered as hosts.
type fleet struct {
	Control *testenv.Control
	Agents  map[string]*testenv.Agent // by host name
}

// Sim host capacity in the tests: small enough that a "huge" VM fits nowhere.
const (
	testHostVCPUs     = 8
	testHostMemoryMiB = 16384
	testHostDiskMiB   = 200000
)

func newFleet(t *testing.T, hostNames ...string) *fleet {
	t.Helper()
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	for _, name := range hostNames {
		f.addHost(t, name)
	}
	return f
}

func (f *fleet) addHost(t *testing.T, name string) *testenv.Agent {
	t.Helper()
	return f.addHostWith(t, name, testenv.AgentOptions{
		VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB, DiskMiB: testHostDiskMiB,
	})
}

func (f *fleet) addHostWith(t *testing.T, name string, opts testenv.AgentOptions) *testenv.Agent {
	t.Helper()
	a := testenv.StartAgent(t, opts)
	f.Control.RegisterHost(t, name, a.Address)
	f.Agents[name] = a
	return a
}

// startAgent starts a sim agent that no host registration names yet.
func (f *fleet) startAgent(t *testing.T) *testenv.Agent {
	t.Helper()
	return testenv.StartAgent(t, testenv.AgentOptions{
		VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB, DiskMiB: testHostDiskMiB,
	})
}

// providerBlock configures the provider for this fleet.
func (f *fleet) providerBlock() string {
	return fmt.Sprintf(`
provider "kvm" {
  endpoint    = %q
  token       = %q
  max_retries = 3
}
`, f.Control.URL, f.Control.Token)
}

// factories serves the provider in process; opts reach every instance.
func factories(opts ...provider.Option) map[string]func() (tfprotov6.ProviderServer, error) {
	return map[string]func() (tfprotov6.ProviderServer, error){
		"kvm": providerserver.NewProtocol6WithError(provider.New("test", opts...)()),
	}
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// checkFleetEmpty is the CheckDestroy of every test: no VM on the control
// API, none on any agent, and nothing allocated on any host.
func (f *fleet) checkFleetEmpty(*terraform.State) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var errs []error
	vms, err := f.Control.Client.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return fmt.Errorf("listing VMs after destroy: %w", err)
	}
	for _, vm := range vms {
		errs = append(errs, fmt.Errorf("VM %s (%q) still exists on the control API after destroy", vm.ID, vm.Name))
	}
	for name, a := range f.Agents {
		avms, err := a.Client.ListVMs(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("listing VMs of agent %s: %w", name, err))
			continue
		}
		for _, vm := range avms {
			errs = append(errs, fmt.Errorf("VM %s still exists on agent %s after destroy", vm.ID, name))
		}
	}
	hosts, err := f.Control.Client.AllHosts(ctx)
	if err != nil {
		return fmt.Errorf("listing hosts after destroy: %w", err)
	}
	for _, h := range hosts {
		if h.Allocated != (api.Resources{}) {
			errs = append(errs, fmt.Errorf("host %s still has %+v allocated after destroy", h.Name, h.Allocated))
		}
	}
	return errors.Join(errs...)
}

// waitFor polls cond until it holds or a minute passes.
func waitFor(t *testing.T, what string, cond func(ctx context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var lastErr error
	for {
		ok, err := cond(ctx)
		if ok {
			return
		}
		if err != nil {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: gave up after a minute (last error: %v)", what, lastErr)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// captureAttr returns a check that stores an attribute of a resource in *dst,
// for a later PreConfig to act on the object behind Terraform's back.
func captureAttr(addr, attr string, dst *string) func(*terraform.State) error {
	return func(s *terraform.State) error {
		rs, ok := s.RootModule().Resources[addr]
		if !ok {
			return fmt.Errorf("%s is not in state", addr)
		}
		v, ok := rs.Primary.Attributes[attr]
		if !ok || v == "" {
			return fmt.Errorf("%s has no %s in state", addr, attr)
		}
		*dst = v
		return nil
	}
}

// requestCounter counts the control API requests of one provider instance,
// by method and path pattern ("GET /v1/vms/{id}").
type requestCounter struct {
	next http.RoundTripper
	mu   sync.Mutex
	n    map[string]int
}

func (c *requestCounter) RoundTrip(req *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.n[req.Method+" "+pathPattern(req.URL.Path)]++
	c.mu.Unlock()
	return c.next.RoundTrip(req)
}

func (c *requestCounter) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

// pathPattern replaces the id segment of /v1/<kind>/<id> by {id}.
func pathPattern(p string) string {
	parts := strings.Split(strings.Trim(p, "/"), "/")
	if len(parts) >= 3 && parts[0] == "v1" {
		parts[2] = "{id}"
	}
	return "/" + strings.Join(parts, "/")
}

// countingFactories gives every provider instance (one per terraform
// command) its own request counter, kept in *counters.
func countingFactories(mu *sync.Mutex, counters *[]*requestCounter) map[string]func() (tfprotov6.ProviderServer, error) {
	return map[string]func() (tfprotov6.ProviderServer, error){
		"kvm": func() (tfprotov6.ProviderServer, error) {
			rc := &requestCounter{next: http.DefaultTransport, n: map[string]int{}}
			mu.Lock()
			*counters = append(*counters, rc)
			mu.Unlock()
			return providerserver.NewProtocol6WithError(provider.New("test", provider.WithHTTPClient(&http.Client{Transport: rc}))())()
		},
	}
}

// loseFirstAnswer forwards the first POST to path (a create) to the control API
// and then reports a broken connection instead of its answer, as a network
// failure after the request arrived would. It records the Idempotency-Key
// of every create it sees.
type loseFirstAnswer struct {
	path string // the create endpoint, e.g. /v1/vms
	next http.RoundTripper
	mu   sync.Mutex
	lost bool
	keys []string
}

func (l *loseFirstAnswer) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodPost || req.URL.Path != l.path {
		return l.next.RoundTrip(req)
	}
	l.mu.Lock()
	l.keys = append(l.keys, req.Header.Get("Idempotency-Key"))
	lose := !l.lost
	l.lost = true
	l.mu.Unlock()
	resp, err := l.next.RoundTrip(req)
	if !lose || err != nil {
		return resp, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return nil, errors.New("read: connection reset by peer (injected: the answer to the first create was lost)")
}

func (l *loseFirstAnswer) createKeys() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.keys...)
}
