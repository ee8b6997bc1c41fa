package testenv

import (
	"bytes"
	"io"
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
	// HoldDeletes, when set, holds every VM delete (DELETE /v1/vms/{id})
	// until it is cleared or its caller gives up: a hung agent.
	HoldDeletes atomic.Bool
	// Creates counts the VM creates that reached the proxy.
	Creates atomic.Int64
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
		// Read the body first: only then does the server notice a caller
		// that gives up (and cancel r's context).
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		vmCall := strings.HasPrefix(r.URL.Path, "/v1/vms/")
		if vmCall && r.Method == http.MethodPut {
			s.Creates.Add(1)
		}
		if s.Slow.Load() && vmCall && r.Method == http.MethodPut {
			select {
			case <-time.After(delay):
			case <-r.Context().Done():
				return
			}
		}
		for vmCall && r.Method == http.MethodDelete && s.HoldDeletes.Load() {
			select {
			case <-time.After(20 * time.Millisecond):
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
