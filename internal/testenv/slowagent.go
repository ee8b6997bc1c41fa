package testenv

import (
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// SlowAgent is a sim agent behind a proxy that, while Slow is set, holds
// every VM create (PUT /v1/vms/{id}) for Delay before passing it on: a
// create slower than its caller's timeouts, while the control API keeps
// going. Register the host at Address (the proxy, which the agent proves
// its identity for); Agent.Client talks to the agent directly.
type SlowAgent struct {
	*Agent
	// Address is the proxy's address (it shadows Agent.Address).
	Address string
	Slow    atomic.Bool
}

// StartSlowAgent starts a sim agent behind a create-delaying proxy; Slow
// starts set.
func StartSlowAgent(t testing.TB, opts AgentOptions, delay time.Duration) *SlowAgent {
	t.Helper()
	a := StartAgent(t, opts)
	target, err := url.Parse(a.URL)
	if err != nil {
		t.Fatal(err)
	}
	s := &SlowAgent{Agent: a}
	s.Slow.Store(true)
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.Slow.Load() && r.Method == http.MethodPut && strings.HasPrefix(r.URL.Path, "/v1/vms/") {
			select {
			case <-time.After(delay):
			case <-r.Context().Done():
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	a.AllowAddress(t, srv.URL)
	s.Address = srv.URL
	return s
}
