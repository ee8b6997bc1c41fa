package faulttest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond until it returns nil; after a generous deadline
// it fails the test with cond's last error. It asserts no timing.
func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting: %s: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func apiCode(err error) string {
	var e *client.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

func smallVM(name string) api.VMCreate {
	return api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 1024, DiskMiB: 1024}
}

// agentLister lists the VMs of one agent (a real one or a double).
type agentLister func(ctx context.Context) ([]string, error)

func realAgent(a *testenv.Agent) agentLister {
	return func(ctx context.Context) ([]string, error) {
		vms, err := a.Client.ListVMs(ctx)
		ids := make([]string, 0, len(vms))
		for _, v := range vms {
			ids = append(ids, v.ID)
		}
		return ids, err
	}
}

// ledger checks through the control API that no host is over capacity,
// that each host's allocation equals the sum of its VM rows that hold
// capacity (every state but missing and lost), that no row is left in creating,
// and that each agent runs exactly the VMs whose rows hold capacity on
// its host. It returns the first disagreement.
func ledger(ctx context.Context, c *client.Client, agents map[string]agentLister) error {
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	sum := map[string]api.Resources{}
	rows := map[string][]string{}
	for _, vm := range vms {
		if vm.ObservedState == api.StateCreating {
			return fmt.Errorf("vm %s (%s) on %s is still creating", vm.ID, vm.Name, vm.Host)
		}
		if api.Gone(vm.ObservedState) {
			continue
		}
		s := sum[vm.Host]
		s.VCPUs += vm.VCPUs
		s.MemoryMiB += vm.MemoryMiB
		s.DiskMiB += vm.DiskMiB
		sum[vm.Host] = s
		rows[vm.Host] = append(rows[vm.Host], vm.ID)
	}
	var problems []string
	for _, h := range hosts {
		a, cp := h.Allocated, h.Capacity
		if a.VCPUs > cp.VCPUs || a.MemoryMiB > cp.MemoryMiB || a.DiskMiB > cp.DiskMiB {
			problems = append(problems, fmt.Sprintf("host %s over capacity: allocated %+v, capacity %+v", h.Name, a, cp))
		}
		if a != sum[h.Name] {
			problems = append(problems, fmt.Sprintf("host %s: allocated %+v, its VM rows add up to %+v", h.Name, a, sum[h.Name]))
		}
		list, ok := agents[h.Name]
		if !ok {
			continue
		}
		got, err := list(ctx)
		if err != nil {
			return fmt.Errorf("list VMs of the agent of %s: %w", h.Name, err)
		}
		want := rows[h.Name]
		sort.Strings(got)
		sort.Strings(want)
		if strings.Join(got, ",") != strings.Join(want, ",") {
			problems = append(problems, fmt.Sprintf("host %s: agent runs %d VMs %v, rows hold %d %v", h.Name, len(got), got, len(want), want))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// ready asks GET /readyz; nil means 200.
func ready(ctx context.Context, baseURL string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/readyz", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/readyz answered %d", resp.StatusCode)
	}
	return nil
}

// callGate sits between kvmd control and an agent. The first call that
// matches is held there (after the agent answered it when forward is set,
// else before the agent sees it) and reached is closed; it is released
// only when its caller goes away (the kill) or the test ends. Every other
// call passes.
type callGate struct {
	match   func(r *http.Request) bool
	forward bool
	reached chan struct{}
	stop    chan struct{}
	abort   chan struct{} // closed by the test: the held call's connection is cut
	held    atomic.Bool
	address string
}

func startCallGate(t *testing.T, agentURL string, forward bool, match func(r *http.Request) bool) *callGate {
	t.Helper()
	g := &callGate{match: match, forward: forward, reached: make(chan struct{}), stop: make(chan struct{}), abort: make(chan struct{})}
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !g.match(r) || !g.held.CompareAndSwap(false, true) {
			proxy.ServeHTTP(w, r)
			return
		}
		if g.forward {
			proxy.ServeHTTP(httptest.NewRecorder(), r.WithContext(context.WithoutCancel(r.Context())))
		} else {
			_, _ = io.Copy(io.Discard, r.Body)
		}
		close(g.reached)
		select {
		case <-r.Context().Done():
		case <-g.stop:
		case <-g.abort:
			panic(http.ErrAbortHandler)
		}
	}))
	t.Cleanup(func() { close(g.stop); srv.Close() })
	g.address = srv.URL
	return g
}
