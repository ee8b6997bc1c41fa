package httpapi

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpserver"
)

// The one place where requests are authenticated and scopes decided.
//
// A /v1 request carries `Authorization: Bearer <token>`: the bootstrap
// token of --token (every scope) or a token from the database (POST
// /v1/tokens, `kvmd token create`). No token, or one that is unknown,
// revoked or expired: 401. A token whose scopes do not allow the route: 403.
//
// Scopes by route (the route pattern Echo matched):
//   - admin: hosts, networks, images, projects and tokens (tokens: reads too);
//   - user:  VMs, forks, placements and volumes;
//   - either: reads (GET, HEAD) of everything but tokens, and the answer to
//     a path no route serves (404 no_route, after the token check).
//
// Scopes do not imply one another: admin is not user (an admin-only token
// cannot create or delete a VM). So a token may create only tokens whose
// scopes it holds itself (mayGrant): an admin-only token cannot make
// itself a user token. The bootstrap token holds both.
//
// A route under /v1 that none of these rules names is refused with 403 for
// every token, so a new route cannot be served without a scope decision
// (TestScopeMatrix walks every route).

// scopeRule is who may call a route: any of these scopes.
type scopeRule []string

var (
	adminOnly   = scopeRule{api.ScopeAdmin}
	userOnly    = scopeRule{api.ScopeUser}
	adminOrUser = scopeRule{api.ScopeAdmin, api.ScopeUser}
)

// RouteScopes says which scopes may call method on route (an Echo route
// pattern such as /v1/vms/:id); ok is false when no rule decides the route.
func RouteScopes(method, route string) (scopes []string, ok bool) {
	if route == "/v1" || route == "/v1/*" { // Echo's route-not-found routes of the group
		return adminOrUser, true
	}
	rest, found := strings.CutPrefix(route, "/v1/")
	if !found {
		return nil, false
	}
	kind, _, _ := strings.Cut(rest, "/")
	read := method == http.MethodGet || method == http.MethodHead
	switch kind {
	case "tokens":
		return adminOnly, true
	case "hosts", "networks", "images":
		// Writes, POST /v1/hosts/:name/retire included, are admin only.
		if read {
			return adminOrUser, true
		}
		return adminOnly, true
	case "whoami", "info":
		return adminOrUser, true
	case "projects":
		// A project token reads its own project (its usage and quotas).
		if read {
			return adminOrUser, true
		}
		return adminOnly, true
	case "vms", "forks", "placements", "volumes":
		if read {
			return adminOrUser, true
		}
		return userOnly, true
	}
	return nil, false
}

// principalKey is where authenticate leaves the request's principal.
const principalKey = "kvmd.principal"

// tokens tells who holds a token: the bootstrap token (--token) or a
// token of the database. The /v1 middleware and the fleet page both ask it,
// so a token means the same everywhere.
type tokens struct {
	svc       *control.Service
	bootstrap [sha256.Size]byte
}

func newTokens(svc *control.Service, bootstrap string) tokens {
	return tokens{svc: svc, bootstrap: sha256.Sum256([]byte(bootstrap))}
}

// authenticate returns the principal of a token secret. An unknown,
// revoked or expired token is a control.Error with code unauthorized.
func (t tokens) authenticate(ctx context.Context, secret string) (control.Principal, error) {
	// The bootstrap token is compared as digests in constant time, so not
	// even its length leaks.
	got := sha256.Sum256([]byte(secret))
	if subtle.ConstantTimeCompare(got[:], t.bootstrap[:]) == 1 {
		return control.BootstrapPrincipal(), nil
	}
	return t.svc.Authenticate(ctx, secret)
}

// authenticateDigest is authenticate for the hex SHA-256 of a secret (what
// a fleet page session holds): the token must still be valid.
func (t tokens) authenticateDigest(ctx context.Context, digest string) (control.Principal, error) {
	got, err := hex.DecodeString(digest)
	if err == nil && subtle.ConstantTimeCompare(got, t.bootstrap[:]) == 1 {
		return control.BootstrapPrincipal(), nil
	}
	if err != nil || len(got) != sha256.Size {
		return control.Principal{}, &control.Error{Code: api.CodeUnauthorized, Message: "unauthorized"}
	}
	return t.svc.AuthenticateDigest(ctx, digest)
}

// isUnauthorized says whether err is a refused token (not a failure to check).
func isUnauthorized(err error) bool {
	var ce *control.Error
	return errors.As(err, &ce) && ce.Code == api.CodeUnauthorized
}

// authenticate checks the bearer token and then the route's scopes.
func authenticate(t tokens) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			secret, ok := httpserver.BearerToken(c.Request())
			if !ok {
				return unauthorized(c)
			}
			p, err := t.authenticate(c.Request().Context(), secret)
			if err != nil {
				if isUnauthorized(err) {
					return unauthorized(c)
				}
				return err
			}
			c.Set(principalKey, p) // the request log names it, refused or not
			// The principal's project scopes what the request sees;
			// Idempotency-Keys are kept per caller.
			c.SetRequest(c.Request().WithContext(control.WithPrincipal(c.Request().Context(), p)))
			scopes, ok := RouteScopes(c.Request().Method, c.Path())
			if !ok || !holdsAny(p, scopes) {
				return &control.Error{Code: api.CodeForbidden,
					Message: "this token's scopes (" + strings.Join(p.Scopes, ", ") + ") do not allow " +
						c.Request().Method + " " + c.Path() + "; it needs " + describeScopes(scopes, ok)}
			}
			return next(c)
		}
	}
}

// mayGrant refuses a token request for a scope the caller does not hold
// (403): minting a token must not widen what its maker can do. Unknown
// scopes are left to the request's validation (400).
func mayGrant(p control.Principal, scopes []string) error {
	for _, sc := range scopes {
		if (sc == api.ScopeAdmin || sc == api.ScopeUser) && !p.Has(sc) {
			return &control.Error{Code: api.CodeForbidden, Details: map[string]any{"scope": sc},
				Message: "this token's scopes (" + strings.Join(p.Scopes, ", ") + ") do not include scope " + strconv.Quote(sc) +
					": a token may create only tokens with scopes it holds itself; create it with a token that holds " +
					strconv.Quote(sc) + " (the bootstrap token holds every scope)"}
		}
	}
	return nil
}

// principalName says who acted, for the request log (never the secret).
func principalName(p control.Principal) string {
	if p.TokenID == "" {
		return p.Name
	}
	return p.TokenID + " (" + p.Name + ")"
}

func unauthorized(c echo.Context) error {
	c.Response().Header().Set(echo.HeaderWWWAuthenticate, `Bearer realm="kvmd"`)
	return &control.Error{Code: api.CodeUnauthorized, Message: "unauthorized"}
}

func holdsAny(p control.Principal, scopes []string) bool {
	for _, s := range scopes {
		if p.Has(s) {
			return true
		}
	}
	return false
}

func describeScopes(scopes []string, ok bool) string {
	if !ok {
		return "a scope decision this server does not have (report this route as a bug)"
	}
	return "scope " + strings.Join(scopes, " or ")
}
