package httpapi_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// openRoutes are the only routes served without a token.
var openRoutes = map[string]bool{"GET /healthz": true, "GET /readyz": true, "GET /metrics": true}

// isUIRoute says whether a route belongs to the fleet page, which answers a
// refusal with its HTML login form (still 401) instead of the JSON envelope.
func isUIRoute(path string) bool { return path == "/ui" || strings.HasPrefix(path, "/ui/") }

// concretePath fills every path parameter of an Echo route with a value.
func concretePath(p string) string {
	parts := strings.Split(p, "/")
	for i, s := range parts {
		if strings.HasPrefix(s, ":") || s == "*" {
			parts[i] = "x"
		}
	}
	return strings.Join(parts, "/")
}

// routeMethod is the method to call a route with: Echo lists the group's
// not-found routes under a pseudo method, answered for any real method.
func routeMethod(r *echo.Route) string {
	if strings.HasPrefix(r.Method, "echo_") {
		return http.MethodGet
	}
	return r.Method
}

// TestEveryRouteRefusesMissingAndWrongTokens walks the handler's own route
// list, so a route added later cannot skip authentication unnoticed.
func TestEveryRouteRefusesMissingAndWrongTokens(t *testing.T) {
	fc := newFuzzControl(t)
	e, ok := fc.handler.(*echo.Echo)
	if !ok {
		t.Fatalf("httpapi.New returned %T; this test walks the routes of an *echo.Echo", fc.handler)
	}
	const unauthorized = `{"error":{"code":"unauthorized","message":"unauthorized"}}`
	refusals := map[string]string{
		"missing":              "",
		"wrong":                "Bearer wrong-token",
		"agent token":          "Bearer agent-token",
		"token without scheme": fc.token,
		"basic scheme":         "Basic " + fc.token,
		"token with suffix":    "Bearer " + fc.token + "x",
		"token prefix":         "Bearer " + fc.token[:len(fc.token)-1],
		"lower-case scheme":    "bearer " + fc.token,
	}
	protected, open := 0, map[string]bool{}
	for _, r := range e.Routes() {
		method, path := routeMethod(r), concretePath(r.Path)
		key := r.Method + " " + r.Path
		if openRoutes[key] {
			open[key] = true
			if code := call(fc.handler, method, path, ""); code == http.StatusUnauthorized {
				t.Errorf("%s must be open: got 401", key)
			}
			continue
		}
		protected++
		for name, auth := range refusals {
			rec := callRec(fc.handler, method, path, auth)
			if isUIRoute(r.Path) {
				if rec.Code != http.StatusUnauthorized || !strings.Contains(rec.Body.String(), `name="token"`) {
					t.Errorf("%s with a %s token: %d %s; want 401 with the login form", key, name, rec.Code, rec.Body.String())
				}
			} else if rec.Code != http.StatusUnauthorized || strings.TrimSpace(rec.Body.String()) != unauthorized {
				t.Errorf("%s with a %s token: %d %s; want 401 %s", key, name, rec.Code, rec.Body.String(), unauthorized)
			}
			if rec.Header().Get("WWW-Authenticate") == "" {
				t.Errorf("%s with a %s token: 401 without WWW-Authenticate", key, name)
			}
		}
		// The right token gets past the check (the route may still refuse
		// the empty request): proves the refusals above are about the token.
		if code := call(fc.handler, method, path, "Bearer "+fc.token); code == http.StatusUnauthorized {
			t.Errorf("%s with the right token: 401", key)
		}
	}
	if len(open) != len(openRoutes) {
		t.Errorf("open routes served: %v; want %v", open, openRoutes)
	}
	// The API has at least its ten /v1 routes; fewer means the walk saw a
	// different handler than the one served.
	if protected < 10 {
		t.Errorf("only %d protected routes walked", protected)
	}
}

func callRec(h http.Handler, method, path, auth string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, strings.NewReader(`{}`))
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

func call(h http.Handler, method, path, auth string) int { return callRec(h, method, path, auth).Code }

// TestBodyLimit: a body over 1 MiB is refused with 413 on every route
// that reads one, and one just under the limit is read.
func TestBodyLimit(t *testing.T) {
	fc := newFuzzControl(t)
	over := `{"name":"` + strings.Repeat("x", 1<<20) + `"}`
	under := `{"name":"` + strings.Repeat("x", 1<<20-100) + `"}`
	for _, r := range []struct{ method, path string }{
		{http.MethodPost, "/v1/vms"}, {http.MethodPatch, "/v1/vms/" + fc.vmID},
		{http.MethodPut, "/v1/hosts/h2"}, {http.MethodPost, "/v1/placements"},
	} {
		for _, tc := range []struct {
			body string
			want int
		}{{over, http.StatusRequestEntityTooLarge}, {under, http.StatusBadRequest}} {
			req := httptest.NewRequest(r.method, r.path, strings.NewReader(tc.body))
			req.Header.Set("Authorization", "Bearer "+fc.token)
			rec := httptest.NewRecorder()
			fc.handler.ServeHTTP(rec, req)
			if rec.Code != tc.want {
				t.Errorf("%s %s with %d bytes: %d %s; want %d", r.method, r.path, len(tc.body), rec.Code, trim(rec.Body.String()), tc.want)
			}
			if tc.want == http.StatusRequestEntityTooLarge && !strings.Contains(rec.Body.String(), `"code":"too_large"`) {
				t.Errorf("%s %s over the limit: %s", r.method, r.path, trim(rec.Body.String()))
			}
		}
	}
}

func trim(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return s
}

// TestOneRequestCreatesBoundedVMs: a create makes one VM, and a fork or a
// fork update asking for more than control.MaxForkChildren children is
// refused before anything is made.
func TestOneRequestCreatesBoundedVMs(t *testing.T) {
	fc := newFuzzControl(t)
	if fc.forkID == "" {
		t.Fatal("the fork routes are not served")
	}
	tooMany := control.MaxForkChildren + 1
	for _, r := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/forks", fmt.Sprintf(`{"source_vm_id":%q,"count":%d}`, fc.vmID, tooMany)},
		{http.MethodPatch, "/v1/forks/" + fc.forkID, fmt.Sprintf(`{"count":%d}`, tooMany)},
	} {
		status := fc.do(t, r.method, r.path, []byte(r.body), nil, false)
		if status != http.StatusBadRequest {
			t.Errorf("%s %s with count %d: %d; want 400", r.method, r.path, tooMany, status)
		}
	}
	// A fork within the limit makes exactly its count of VMs.
	before := len(fc.snapshot(t).vms)
	if status := fc.do(t, http.MethodPost, "/v1/forks", []byte(fmt.Sprintf(`{"source_vm_id":%q,"count":%d}`, fc.vmID, 3)), nil, false); status != http.StatusCreated {
		t.Fatalf("fork of 3: %d", status)
	}
	if after := len(fc.snapshot(t).vms); after != before+3 {
		t.Errorf("a fork of 3 made %d VMs", after-before)
	}
}

// scopeMatrix is who may call each route, written out here on purpose (not
// derived from httpapi.RouteScopes): "admin", "user", or both. A route the
// server serves that is missing here fails TestScopeMatrix, so every new
// route needs a scope decision.
var scopeMatrix = map[string][]string{
	"GET /v1/info":                       {"admin", "user"},
	"PUT /v1/hosts/:name":                {"admin"},
	"GET /v1/hosts":                      {"admin", "user"},
	"GET /v1/hosts/:name":                {"admin", "user"},
	"DELETE /v1/hosts/:name":             {"admin"},
	"POST /v1/hosts/:name/retire":        {"admin"},
	"POST /v1/vms":                       {"user"},
	"GET /v1/vms":                        {"admin", "user"},
	"GET /v1/vms/:id":                    {"admin", "user"},
	"GET /v1/vms/:id/console":            {"admin", "user"},
	"GET /v1/vms/:id/guest":              {"admin", "user"},
	"PATCH /v1/vms/:id":                  {"user"},
	"DELETE /v1/vms/:id":                 {"user"},
	"POST /v1/placements":                {"user"},
	"POST /v1/forks":                     {"user"},
	"GET /v1/forks/:id":                  {"admin", "user"},
	"PATCH /v1/forks/:id":                {"user"},
	"DELETE /v1/forks/:id":               {"user"},
	"POST /v1/networks":                  {"admin"},
	"GET /v1/networks":                   {"admin", "user"},
	"GET /v1/networks/:name":             {"admin", "user"},
	"PATCH /v1/networks/:name":           {"admin"},
	"DELETE /v1/networks/:name":          {"admin"},
	"POST /v1/images":                    {"admin"},
	"GET /v1/images":                     {"admin", "user"},
	"GET /v1/images/:name":               {"admin", "user"},
	"PATCH /v1/images/:name":             {"admin"},
	"DELETE /v1/images/:name":            {"admin"},
	"POST /v1/projects":                  {"admin"},
	"GET /v1/projects":                   {"admin", "user"},
	"GET /v1/projects/:name":             {"admin", "user"},
	"PATCH /v1/projects/:name":           {"admin"},
	"DELETE /v1/projects/:name":          {"admin"},
	"GET /v1/whoami":                     {"admin", "user"},
	"POST /v1/volumes":                   {"user"},
	"GET /v1/volumes":                    {"admin", "user"},
	"GET /v1/volumes/:ref":               {"admin", "user"},
	"PATCH /v1/volumes/:ref":             {"user"},
	"POST /v1/volumes/:ref/resize":       {"user"},
	"POST /v1/volumes/:ref/move":         {"user"},
	"DELETE /v1/volumes/:ref":            {"user"},
	"POST /v1/vms/:id/volumes":           {"user"},
	"DELETE /v1/vms/:id/volumes/:volume": {"user"},
	"POST /v1/tokens":                    {"admin"},
	"GET /v1/tokens":                     {"admin"},
	"DELETE /v1/tokens/:id":              {"admin"},
	"POST /v1/hosts/:name/drain":         {"admin"},
	"POST /v1/hosts/:name/undrain":       {"admin"},
	"POST /v1/vms/:id/migrate":           {"user"},
	// A path no route serves answers 404 no_route to any valid token.
	"echo_route_not_found /v1/*": {"admin", "user"},
	"echo_route_not_found /v1":   {"admin", "user"},
}

// TestScopeMatrix walks every route the server serves with every kind of
// token: the bootstrap token and an admin+user token get past the scope
// check everywhere; an admin token and a user token only where the matrix
// says (403 forbidden elsewhere); missing, unknown, revoked and expired
// tokens get 401 everywhere.
func TestScopeMatrix(t *testing.T) {
	fc := newFuzzControl(t)
	e, ok := fc.handler.(*echo.Echo)
	if !ok {
		t.Fatalf("httpapi.New returned %T; this test walks the routes of an *echo.Echo", fc.handler)
	}
	ctx := context.Background()
	newToken := func(name string, scopes ...string) api.Token {
		tok, err := fc.svc.CreateToken(ctx, api.TokenCreate{Name: name, Scopes: scopes})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	admin, user, both := newToken("admin", "admin"), newToken("user", "user"), newToken("both", "admin", "user")
	revoked := newToken("revoked", "admin", "user")
	if err := fc.svc.RevokeToken(ctx, revoked.ID); err != nil {
		t.Fatal(err)
	}
	const expiredSecret = "kvmd_expired-token-of-the-scope-matrix-0123456789abcdef"
	sum := sha256.Sum256([]byte(expiredSecret))
	past := time.Now().Add(-time.Second).UTC()
	if err := fc.store.InsertToken(ctx, store.Token{ID: "expired", Name: "expired", SecretSHA256: hex.EncodeToString(sum[:]),
		Scopes: []string{"admin", "user"}, ExpiresAt: &past}); err != nil {
		t.Fatal(err)
	}
	holders := map[string]struct {
		secret string
		scopes []string
	}{
		"bootstrap":  {fc.token, []string{"admin", "user"}},
		"admin+user": {both.Secret, []string{"admin", "user"}},
		"admin":      {admin.Secret, []string{"admin"}},
		"user":       {user.Secret, []string{"user"}},
	}
	refused := map[string]string{
		"missing": "", "unknown": "Bearer kvmd_not-a-token-this-server-made",
		"revoked": "Bearer " + revoked.Secret, "expired": "Bearer " + expiredSecret,
	}
	seen := map[string]bool{}
	for _, r := range e.Routes() {
		key := r.Method + " " + r.Path
		if openRoutes[key] || isUIRoute(r.Path) {
			// The fleet page logs in with the bootstrap token and a session
			// cookie of its own (ui_test.go), not with bearer tokens.
			continue
		}
		if strings.HasPrefix(r.Method, "echo_") {
			key = "echo_route_not_found " + r.Path
		}
		allowed, decided := scopeMatrix[key]
		if !decided {
			t.Errorf("route %s has no scope decision in scopeMatrix: decide who may call it (here and in httpapi.RouteScopes)", key)
			continue
		}
		seen[key] = true
		if _, ok := httpapi.RouteScopes(r.Method, r.Path); !ok && !strings.HasPrefix(r.Method, "echo_") {
			t.Errorf("route %s: httpapi.RouteScopes has no rule for it", key)
		}
		method, path := routeMethod(r), concretePath(r.Path)
		for name, h := range holders {
			rec := callRec(fc.handler, method, path, "Bearer "+h.secret)
			mayCall := false
			for _, s := range h.scopes {
				mayCall = mayCall || slices.Contains(allowed, s)
			}
			switch {
			case mayCall && (rec.Code == http.StatusUnauthorized || rec.Code == http.StatusForbidden):
				t.Errorf("%s with a %s token: %d %s; the matrix allows it", key, name, rec.Code, trim(rec.Body.String()))
			case !mayCall && (rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), `"code":"forbidden"`)):
				t.Errorf("%s with a %s token: %d %s; want 403 forbidden", key, name, rec.Code, trim(rec.Body.String()))
			}
		}
		for name, auth := range refused {
			if rec := callRec(fc.handler, method, path, auth); rec.Code != http.StatusUnauthorized {
				t.Errorf("%s with a %s token: %d %s; want 401", key, name, rec.Code, trim(rec.Body.String()))
			}
		}
	}
	for key := range scopeMatrix {
		if !seen[key] {
			t.Errorf("scopeMatrix names %s, which the server does not serve", key)
		}
	}
}
