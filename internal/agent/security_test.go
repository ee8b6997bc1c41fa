package agent_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// TestEveryAgentRouteRefusesMissingAndWrongTokens walks the handler's own
// route list, so a route added later cannot skip authentication unnoticed.
func TestEveryAgentRouteRefusesMissingAndWrongTokens(t *testing.T) {
	fa := newFuzzAgent(t)
	e, ok := fa.agent.Handler().(*echo.Echo)
	if !ok {
		t.Fatalf("Agent.Handler is %T; this test walks the routes of an *echo.Echo", fa.agent.Handler())
	}
	openRoutes := map[string]bool{"GET /healthz": true, "GET /metrics": true, "POST /v1/identity": true}
	refusals := map[string]string{
		"missing":              "",
		"wrong":                "Bearer wrong-token",
		"control token":        "Bearer control-token",
		"token without scheme": token,
		"basic scheme":         "Basic " + token,
		"token with suffix":    "Bearer " + token + "x",
		"token prefix":         "Bearer " + token[:len(token)-1],
	}
	protected, open := 0, map[string]bool{}
	for _, r := range e.Routes() {
		method, path := r.Method, fillParams(r.Path)
		if strings.HasPrefix(method, "echo_") { // the group's not-found routes
			method = http.MethodGet
		}
		key := r.Method + " " + r.Path
		if openRoutes[key] {
			open[key] = true
			if rec := agentCall(e, method, path, ""); rec.Code == http.StatusUnauthorized {
				t.Errorf("%s must be open: got 401", key)
			}
			continue
		}
		protected++
		for name, auth := range refusals {
			rec := agentCall(e, method, path, auth)
			var env agentapi.ErrorBody
			if rec.Code != http.StatusUnauthorized || json.Unmarshal(rec.Body.Bytes(), &env) != nil ||
				env.Error.Code != "unauthorized" || env.Error.Details != nil || strings.Contains(rec.Body.String(), token) {
				t.Errorf("%s with a %s token: %d %s; want 401 unauthorized with no details", key, name, rec.Code, rec.Body.String())
			}
		}
		if rec := agentCall(e, method, path, "Bearer "+token); rec.Code == http.StatusUnauthorized {
			t.Errorf("%s with the right token: 401", key)
		}
	}
	if len(open) != len(openRoutes) {
		t.Errorf("open routes served: %v; want %v", open, openRoutes)
	}
	if protected < 12 {
		t.Errorf("only %d protected routes walked", protected)
	}
}

func fillParams(p string) string {
	parts := strings.Split(p, "/")
	for i, s := range parts {
		if strings.HasPrefix(s, ":") || s == "*" {
			parts[i] = "x"
		}
	}
	return strings.Join(parts, "/")
}

func agentCall(h http.Handler, method, path, auth string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, strings.NewReader(`{}`))
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// TestAgentBodyLimit: a body over 1 MiB is refused with 413 on every route
// that reads one, and one just under it is read.
func TestAgentBodyLimit(t *testing.T) {
	fa := newFuzzAgent(t)
	over := `{"image":"` + strings.Repeat("x", 1<<20) + `"}`
	under := `{"image":"` + strings.Repeat("x", 1<<20-100) + `"}`
	for _, path := range []string{"/v1/vms/big", "/v1/snapshots/big", "/v1/pool/sim"} {
		for _, tc := range []struct {
			body string
			want int
		}{{over, http.StatusRequestEntityTooLarge}, {under, http.StatusBadRequest}} {
			req := httptest.NewRequest(http.MethodPut, path, strings.NewReader(tc.body))
			req.Header.Set("Authorization", "Bearer "+token)
			rec := httptest.NewRecorder()
			fa.agent.Handler().ServeHTTP(rec, req)
			body := rec.Body.String()
			if len(body) > 300 {
				body = body[:300]
			}
			if rec.Code != tc.want {
				t.Errorf("PUT %s with %d bytes: %d %s; want %d", path, len(tc.body), rec.Code, body, tc.want)
			}
		}
	}
}
