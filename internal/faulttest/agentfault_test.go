package faulttest

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// faultMode is what faultyProxy does to the requests it matches.
type faultMode int

const (
	pass    faultMode = iota
	hang              // never answer (until the caller gives up or the test ends)
	fail500           // answer 500 without asking the agent
	drop              // forward to the agent, then close the connection without an answer
)

// faultyProxy sits between the control API and a real sim agent and
// injects one fault into the requests that match its scope.
type faultyProxy struct {
	Address string
	proxy   *httputil.ReverseProxy
	stop    chan struct{}

	mu        sync.Mutex
	mode      faultMode
	allCalls  bool // false: only PUT /v1/vms/{id} (creates)
	faultsHit int
}

func startFaultyProxy(t *testing.T, agentURL string) *faultyProxy {
	t.Helper()
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	p := &faultyProxy{proxy: httputil.NewSingleHostReverseProxy(target), stop: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.Address = "http://" + ln.Addr().String()
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		close(p.stop) // releases hung requests
		_ = srv.Close()
	})
	return p
}

func (p *faultyProxy) set(mode faultMode, allCalls bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode, p.allCalls = mode, allCalls
}

func (p *faultyProxy) hits() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faultsHit
}

func (p *faultyProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	mode := p.mode
	isCreate := r.Method == http.MethodPut && strings.HasPrefix(r.URL.Path, "/v1/vms/")
	if !p.allCalls && !isCreate {
		mode = pass
	}
	if mode != pass {
		p.faultsHit++
	}
	p.mu.Unlock()
	switch mode {
	case pass:
		p.proxy.ServeHTTP(w, r)
	case hang:
		select {
		case <-r.Context().Done():
		case <-p.stop:
		}
	case fail500:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"error":{"code":"internal","message":"injected failure"}}`))
	case drop:
		rec := &discardWriter{h: http.Header{}}
		p.proxy.ServeHTTP(rec, r) // the agent does the work...
		hj, ok := w.(http.Hijacker)
		if !ok {
			panic("faulty proxy: connection cannot be hijacked")
		}
		conn, _, err := hj.Hijack()
		if err == nil {
			_ = conn.Close() // ...and the answer is lost
		}
	}
}

type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}

// An agent that answers 500, drops the connection after doing the work,
// or hangs: the create fails within the bound that the agent timeout sets,
// the error names the host, what failed and what to do, no capacity leaks,
// and the host is marked dead after the threshold and alive again after.
func TestAgentFaultsDuringCreate(t *testing.T) {
	const agentTimeout = 300 * time.Millisecond
	ctx := ctxT(t, 3*time.Minute)
	ag := testenv.StartAgent(t, testenv.AgentOptions{})
	px := startFaultyProxy(t, ag.URL)
	ag.AllowAddress(t, px.Address)
	c := testenv.StartControl(t, testenv.ControlOptions{AgentTimeout: agentTimeout, SyncInterval: 200 * time.Millisecond, DeadAfter: 3})
	c.RegisterHost(t, "h1", px.Address)
	agents := map[string]agentLister{"h1": realAgent(ag)}
	cl := client.New(c.URL, c.Token, client.WithRetries(0, 0))
	eventually(t, "h1 synced", func() error {
		h, err := cl.GetHost(ctx, "h1")
		if err == nil && (!h.Alive || h.Capacity.VCPUs == 0) {
			err = errors.New("not synced yet")
		}
		return err
	})

	for _, tc := range []struct {
		name string
		mode faultMode
	}{{"500", fail500}, {"dropped connection", drop}} {
		t.Run(tc.name, func(t *testing.T) {
			px.set(tc.mode, false)
			defer px.set(pass, false)
			start := time.Now()
			_, err := cl.CreateVM(ctx, smallVM("vm-"+strings.ReplaceAll(tc.name, " ", "-")), "")
			t.Logf("create failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
			checkAgentError(t, err)
			// The agent confirmed the delete of the cleanup, so the capacity
			// is released at once and no row is left.
			if err := ledger(ctx, cl, agents); err != nil {
				t.Error(err)
			}
			vms, _ := cl.AllVMs(ctx, client.ListOptions{})
			if len(vms) != 0 {
				t.Errorf("%d VM rows left after a failed create, want 0", len(vms))
			}
		})
	}

	t.Run("hang", func(t *testing.T) {
		px.set(hang, true)
		start := time.Now()
		_, err := cl.CreateVM(ctx, smallVM("vm-hang"), "")
		t.Logf("create failed after %v (agent timeout %v): %v", time.Since(start).Round(time.Millisecond), agentTimeout, err)
		checkAgentError(t, err)
		// The delete of the cleanup hung too: the VM may run, so its row is
		// kept in state error with the capacity held (never released blind).
		var e *client.Error
		if errors.As(err, &e) && !strings.Contains(e.Message, "DELETE") {
			t.Errorf("error does not say the VM is kept and how to clean it up: %s", e.Message)
		}
		vms, _ := cl.AllVMs(ctx, client.ListOptions{})
		if len(vms) != 1 || vms[0].ObservedState == api.StateMissing {
			t.Fatalf("want the one VM kept with its capacity after the hung cleanup, got %+v", vms)
		}
		if h, _ := cl.GetHost(ctx, "h1"); h.Allocated.VCPUs != 1 {
			t.Errorf("allocated %+v while the VM may still run, want its capacity held", h.Allocated)
		}
		eventually(t, "h1 marked dead", func() error {
			if h, err := cl.GetHost(ctx, "h1"); err != nil || h.Alive {
				return fmt.Errorf("alive=%v err=%v", h.Alive, err)
			}
			return nil
		})
		if _, err := cl.CreateVM(ctx, smallVM("vm-on-dead"), ""); apiCode(err) != api.CodeNoCapacity {
			t.Errorf("create on the only, dead host: %v; want no_capacity", err)
		}

		px.set(pass, false)
		eventually(t, "h1 alive again and the kept VM reconciled", func() error {
			h, err := cl.GetHost(ctx, "h1")
			if err != nil || !h.Alive {
				return fmt.Errorf("alive=%v err=%v", h.Alive, err)
			}
			return ledger(ctx, cl, agents)
		})
		vms, _ = cl.AllVMs(ctx, client.ListOptions{})
		for _, vm := range vms {
			if err := cl.DeleteVM(ctx, vm.ID); err != nil {
				t.Errorf("delete %s after recovery: %v", vm.ID, err)
			}
		}
		if _, err := cl.CreateVM(ctx, smallVM("vm-after"), ""); err != nil {
			t.Errorf("create after recovery: %v", err)
		}
		if err := ledger(ctx, cl, agents); err != nil {
			t.Error(err)
		}
	})
	if px.hits() == 0 {
		t.Fatal("the proxy injected no fault")
	}
}

func checkAgentError(t *testing.T, err error) {
	t.Helper()
	var e *client.Error
	if !errors.As(err, &e) {
		t.Fatalf("want an API error, got %v", err)
	}
	if e.Code != api.CodeUnavailable || !strings.Contains(e.Message, "h1") || !strings.Contains(e.Message, "retry") {
		t.Errorf("error should be unavailable, name host h1 and say to retry: %s %q", e.Code, e.Message)
	}
}
