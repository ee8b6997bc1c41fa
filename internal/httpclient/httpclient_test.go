package httpclient_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/httpclient"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

var (
	errUnavailable = errors.New("unavailable")
	errInFlight    = errors.New("in flight")
)

// answerError is a client's translation: 409 is "in flight", 5xx
// unavailable, the rest by status.
func answerError(_ *httpclient.Call, _ string, status int, body []byte) error {
	switch {
	case status == http.StatusConflict:
		return fmt.Errorf("%s: %w", body, errInFlight)
	case status >= 500:
		return fmt.Errorf("%d %s: %w", status, body, errUnavailable)
	}
	return fmt.Errorf("%d: %w", status, httpclient.ByStatus(status, errUnavailable))
}

func newCore(url string, retries int, patient bool) *httpclient.Core {
	p := httpclient.Policy{
		Retries:   retries,
		Backoff:   func(int) time.Duration { return time.Millisecond },
		Retryable: func(err error) bool { return errors.Is(err, errUnavailable) || errors.Is(err, errInFlight) },
	}
	if patient {
		p.Patient = func(call *httpclient.Call, err error) bool {
			return call.IdempotencyKey != "" && errors.Is(err, errInFlight)
		}
	}
	return httpclient.New(url, "secret", p, httpclient.Errors{
		Transport: func(_ *httpclient.Call, _ string, err error, _ bool) error {
			return fmt.Errorf("%w: %v", errUnavailable, err)
		},
		Decode:       func(_ *httpclient.Call, _ string, err error) error { return fmt.Errorf("%w: %v", errUnavailable, err) },
		Answer:       answerError,
		MaxErrorBody: 1 << 10,
	})
}

// A server that answers status for the first fails calls, then 200 with a
// JSON body, a text body for /text, and counts the calls.
func flaky(t *testing.T, fails int, status int) (*httptest.Server, *atomic.Int64) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		if r.Header.Get("Authorization") != "Bearer secret" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if int(n) <= fails {
			w.WriteHeader(status)
			_, _ = w.Write([]byte("busy"))
			return
		}
		w.Header().Set("Server-Timing", "take;dur=1.500, resume;dur=0.250")
		if r.URL.Path == "/text" {
			_, _ = w.Write([]byte("console line\n"))
			return
		}
		_, _ = w.Write([]byte(`{"name":"vm-1"}`))
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}

func TestDoDecodesAnswersAndFoldsServerTiming(t *testing.T) {
	srv, _ := flaky(t, 0, 0)
	c := newCore(srv.URL, 0, false)
	c.TimingPrefix = "agent."
	ctx, rec := timing.NewContext(context.Background())
	var out struct{ Name string }
	if err := c.Do(ctx, &httpclient.Call{Method: http.MethodGet, Path: "/vm", Out: &out, Timeout: time.Minute}); err != nil || out.Name != "vm-1" {
		t.Fatalf("Do: %v, %+v; want vm-1", err, out)
	}
	if got := rec.Header(); got != "agent.take;dur=1.500, agent.resume;dur=0.250" {
		t.Errorf("recorded steps %q; want the answer's Server-Timing with the prefix", got)
	}
	var text string
	if err := c.Do(ctx, &httpclient.Call{Method: http.MethodGet, Path: "/text", Out: &text}); err != nil || text != "console line\n" {
		t.Errorf("text answer: %v, %q; want the body as it is", err, text)
	}
}

func TestDoRetriesUnderItsPolicy(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fails     int
		status    int
		retries   int
		patient   bool
		key       string
		wantErr   error
		wantCalls int64
	}{
		{"retryable failures within the retries", 2, http.StatusServiceUnavailable, 2, false, "", nil, 3},
		{"more retryable failures than retries", 3, http.StatusServiceUnavailable, 2, false, "", errUnavailable, 3},
		{"an answer that is not retryable", 5, http.StatusBadRequest, 4, false, "", httpclient.ErrInvalid, 1},
		{"in flight on its own key: patient beyond the retries", 4, http.StatusConflict, 1, true, "key", nil, 5},
		{"in flight without a key uses up the retries", 4, http.StatusConflict, 1, true, "", errInFlight, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, calls := flaky(t, tc.fails, tc.status)
			c := newCore(srv.URL, tc.retries, tc.patient)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := c.Do(ctx, &httpclient.Call{Method: http.MethodPost, Path: "/vms", In: map[string]int{"n": 1}, IdempotencyKey: tc.key})
			if (tc.wantErr == nil) != (err == nil) || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) {
				t.Errorf("Do: %v; want %v", err, tc.wantErr)
			}
			if calls.Load() != tc.wantCalls {
				t.Errorf("%d calls; want %d", calls.Load(), tc.wantCalls)
			}
		})
	}
}

func TestNoRetryAndAnonymousCalls(t *testing.T) {
	srv, calls := flaky(t, 1, http.StatusServiceUnavailable)
	c := newCore(srv.URL, 3, false)
	if err := c.Do(context.Background(), &httpclient.Call{Method: http.MethodPost, Path: "/tokens", NoRetry: true}); !errors.Is(err, errUnavailable) || calls.Load() != 1 {
		t.Errorf("NoRetry: %v after %d calls; want one unavailable call", err, calls.Load())
	}
	if err := c.Do(context.Background(), &httpclient.Call{Method: http.MethodPost, Path: "/identity", Anonymous: true}); !errors.Is(err, httpclient.ErrInvalid) {
		t.Errorf("anonymous call: %v; want the server's 401 (no token sent) as invalid", err)
	}
}
