package agent_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// TestEveryAgentRouteRefusesASkewedCaller walks the handler's routes: a
// caller (control plane or peer agent) whose level is outside the skew
// contract gets 400 version_skew naming both versions on every /v1 route
// but GET /v1/info (which tells it this agent's version), and nothing is
// done; a caller of the previous level, or one that sends no level (a
// release before levels), is served. Every answer carries the agent's
// version headers.
func TestEveryAgentRouteRefusesASkewedCaller(t *testing.T) {
	fa := newFuzzAgent(t)
	e, ok := fa.agent.Handler().(*echo.Echo)
	if !ok {
		t.Fatalf("Agent.Handler is %T; this test walks the routes of an *echo.Echo", fa.agent.Handler())
	}
	call := func(method, path string, level int) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer "+token)
		if level > 0 {
			req.Header.Set(version.HeaderRelease, "9.0.0")
			req.Header.Set(version.HeaderLevel, strconv.Itoa(level))
		}
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, req)
		return rec
	}
	skewed := version.Current() + version.MaxSkew + 1
	checked := 0
	for _, r := range e.Routes() {
		if !strings.HasPrefix(r.Path, "/v1/") || r.Path == "/v1/identity" || strings.HasPrefix(r.Method, "echo_") {
			continue
		}
		method, path := r.Method, fillParams(r.Path)
		rec := call(method, path, skewed)
		if got := rec.Header().Get(version.HeaderLevel); got != strconv.Itoa(version.Current()) {
			t.Errorf("%s %s: %s header %q, want %d", method, r.Path, version.HeaderLevel, got, version.Current())
		}
		if r.Path == "/v1/info" {
			var info agentapi.Info
			if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &info) != nil || info.APILevel != version.Current() || info.Release != version.Release() {
				t.Errorf("GET /v1/info from a skewed caller: %d %s; want 200 with this agent's release and level", rec.Code, rec.Body.String())
			}
			continue
		}
		checked++
		var env agentapi.ErrorBody
		if rec.Code != http.StatusBadRequest || json.Unmarshal(rec.Body.Bytes(), &env) != nil || env.Error.Code != agentapi.CodeVersionSkew ||
			!strings.Contains(env.Error.Message, "9.0.0 (API level "+strconv.Itoa(skewed)+")") ||
			!strings.Contains(env.Error.Message, version.Self().String()) {
			t.Errorf("%s %s from level %d: %d %s; want 400 %s naming both versions", method, r.Path, skewed, rec.Code, rec.Body.String(), agentapi.CodeVersionSkew)
		}
	}
	if checked < 10 {
		t.Fatalf("only %d /v1 routes checked", checked)
	}
	for _, level := range []int{0, version.Current() - 1} {
		if rec := call(http.MethodGet, "/v1/vms", level); rec.Code != http.StatusOK {
			t.Errorf("GET /v1/vms from level %d (0: none sent): %d %s; want 200", level, rec.Code, rec.Body.String())
		}
	}
}
