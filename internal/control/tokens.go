package control

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Token handling. A token's secret is "kvmd_" and 43 characters of
// base64url (32 random bytes); only its SHA-256 is stored (see migration
// 0003_tokens.sql for why a fast hash is right at this entropy).
//
// Checking a token must not cost a database round trip per request, so
// each replica caches digest -> token for tokenCacheTTL. Expiry is checked
// against the cached row on every request. A revoke on a replica drops its
// own cache entry at once (the next request there is 401); other replicas
// see the revoke when their entry ages out, within tokenCacheTTL.
const (
	tokenSecretPrefix = "kvmd_"
	// TokenCacheTTL bounds how long another replica may still accept a revoked token.
	TokenCacheTTL = 5 * time.Second
	// tokenTouchEvery is how often last_used_at is written per token (at most).
	tokenTouchEvery = time.Minute
	// maxCachedTokens bounds the cache, unknown secrets included (a client
	// spraying random tokens must not grow memory without bound).
	maxCachedTokens = 10000
	maxTokenScopes  = 2
)

// Principal is who a request acts as: a token and its scopes.
type Principal struct {
	TokenID string // "" for the bootstrap token of --token
	Name    string
	Scopes  []string
	// Project is the project a project token acts in ("" for a
	// fleet-wide token): it sees that project's objects only.
	Project string
}

// Has says whether the principal holds scope.
func (p Principal) Has(scope string) bool { return slices.Contains(p.Scopes, scope) }

// Caller names the principal for Idempotency-Keys (WithCaller): its token
// id, or BootstrapCaller for the bootstrap token.
func (p Principal) Caller() string {
	if p.TokenID == "" {
		return BootstrapCaller
	}
	return p.TokenID
}

// BootstrapPrincipal is the --token flag's token: every scope.
func BootstrapPrincipal() Principal {
	return Principal{Name: "bootstrap (--token)", Scopes: []string{api.ScopeAdmin, api.ScopeUser}}
}

type cachedToken struct {
	found   bool // false: no such token (cached too, for the same TTL)
	token   store.Token
	fetched time.Time
}

// tokenCache is the per-replica cache of token digests (zero value ready).
type tokenCache struct {
	mu      sync.Mutex
	byHash  map[string]cachedToken
	touched map[string]time.Time // token id -> last write of last_used_at by this replica
}

func (c *tokenCache) get(hash string, now time.Time) (cachedToken, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.byHash[hash]
	if !ok || now.Sub(e.fetched) >= TokenCacheTTL {
		return cachedToken{}, false
	}
	return e, true
}

func (c *tokenCache) put(hash string, e cachedToken) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byHash == nil || len(c.byHash) >= maxCachedTokens {
		c.byHash = map[string]cachedToken{}
	}
	c.byHash[hash] = e
}

// forget drops every entry of token id (a revoke on this replica).
func (c *tokenCache) forget(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for h, e := range c.byHash {
		if e.found && e.token.ID == id {
			delete(c.byHash, h)
		}
	}
	delete(c.touched, id)
}

// forgetProject drops every entry of a token of project (its delete on
// this replica).
func (c *tokenCache) forgetProject(project string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for h, e := range c.byHash {
		if e.found && e.token.Project != nil && *e.token.Project == project {
			delete(c.byHash, h)
		}
	}
}

// dueForTouch says whether this replica should write last_used_at of id now,
// and if so notes that it does.
func (c *tokenCache) dueForTouch(id string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.touched == nil || len(c.touched) >= maxCachedTokens {
		c.touched = map[string]time.Time{}
	}
	if last, ok := c.touched[id]; ok && now.Sub(last) < tokenTouchEvery {
		return false
	}
	c.touched[id] = now
	return true
}

func secretDigest(secret string) string {
	sum := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(sum[:])
}

func newTokenSecret() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return tokenSecretPrefix + base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// badToken is the answer of Authenticate for a token that is unknown,
// revoked or expired. It says nothing more, on purpose.
func badToken() error { return &Error{Code: api.CodeUnauthorized, Message: "unauthorized"} }

// Authenticate returns the principal of a token secret from the database
// (through the cache). A secret that is unknown, revoked or expired is an
// Error with code unauthorized; a database failure is unavailable.
func (s *Service) Authenticate(ctx context.Context, secret string) (Principal, error) {
	if !strings.HasPrefix(secret, tokenSecretPrefix) {
		return Principal{}, badToken() // not one of ours: no lookup
	}
	return s.AuthenticateDigest(ctx, secretDigest(secret))
}

// AuthenticateDigest is Authenticate for the hex SHA-256 of a secret (a
// fleet page session keeps the digest, never the secret): the token must
// still exist and not have expired.
func (s *Service) AuthenticateDigest(ctx context.Context, hash string) (Principal, error) {
	t := time.Now()
	e, ok := s.tokens.get(hash, t)
	if !ok {
		row, err := s.store.TokenBySecretHash(ctx, hash)
		switch {
		case errors.Is(err, store.ErrNotFound):
			e = cachedToken{fetched: t}
		case err != nil:
			return Principal{}, internal(err, "check the API token")
		default:
			e = cachedToken{found: true, token: row, fetched: t}
		}
		s.tokens.put(hash, e)
	}
	if !e.found || (e.token.ExpiresAt != nil && !t.Before(*e.token.ExpiresAt)) {
		return Principal{}, badToken()
	}
	if s.tokens.dueForTouch(e.token.ID, t) {
		// One small conditional UPDATE per token per minute per replica; a
		// failure costs only the timestamp, never the request.
		if err := s.store.TouchToken(ctx, e.token.ID, t, t.Add(-tokenTouchEvery)); err != nil {
			s.log.Warn("record token use", "token", e.token.ID, "err", err)
		}
	}
	p := Principal{TokenID: e.token.ID, Name: e.token.Name, Scopes: e.token.Scopes}
	if e.token.Project != nil {
		p.Project = *e.token.Project
	}
	return p, nil
}

// CreateToken makes a token and answers its secret, the only time it is shown.
func (s *Service) CreateToken(ctx context.Context, in api.TokenCreate) (api.Token, error) {
	if err := validateName("name", in.Name); err != nil {
		return api.Token{}, err
	}
	scopes, err := validateScopes(in.Scopes)
	if err != nil {
		return api.Token{}, err
	}
	var expires *time.Time
	if in.ExpiresAt != nil {
		at := in.ExpiresAt.UTC()
		if !at.After(time.Now()) {
			return api.Token{}, invalidf("expires_at %s is not in the future", at.Format(time.RFC3339))
		}
		expires = &at
	}
	var project *string
	if in.Project != "" {
		// A project token: it acts in its project alone, so it never holds
		// admin (hosts, images, networks and tokens are fleet-wide), and it
		// is made only by a fleet-wide token.
		if slices.Contains(scopes, api.ScopeAdmin) {
			return api.Token{}, invalidf("a token of project %q cannot hold scope %q: admin acts on the whole fleet; give scopes [%q]",
				in.Project, api.ScopeAdmin, api.ScopeUser)
		}
		if _, err := s.projectFor(ctx, in.Project); err != nil {
			return api.Token{}, err
		}
		project = &in.Project
	}
	secret, err := newTokenSecret()
	if err != nil {
		return api.Token{}, internal(err, "generate a token secret")
	}
	row := store.Token{ID: newID(), Name: in.Name, SecretSHA256: secretDigest(secret), Scopes: scopes,
		ExpiresAt: expires, CreatedAt: time.Now().UTC(), Project: project}
	if err := s.store.InsertToken(ctx, row); err != nil {
		return api.Token{}, fromStore(err, "create token "+in.Name)
	}
	s.log.Info("token created", "token", row.ID, "name", row.Name, "scopes", scopes, "project", in.Project)
	out := apiToken(row)
	out.Secret = secret
	return out, nil
}

// ListTokens returns one page of tokens (never their secrets), by id.
func (s *Service) ListTokens(ctx context.Context, p Page) (api.List[api.Token], error) {
	return listPage(p, func(after string, limit int) ([]store.Token, error) {
		rows, err := s.store.ListTokens(ctx, after, limit)
		return rows, fromStore(err, "list tokens")
	}, func(r store.Token) string { return r.ID }, each(apiToken))
}

// RevokeToken deletes a token. This replica refuses it from the next
// request on; other replicas within TokenCacheTTL.
func (s *Service) RevokeToken(ctx context.Context, id string) error {
	row, err := s.store.DeleteToken(ctx, id)
	if err != nil {
		return fromStore(err, "revoke token "+id)
	}
	s.tokens.forget(id)
	s.log.Info("token revoked", "token", row.ID, "name", row.Name)
	return nil
}

func validateScopes(in []string) ([]string, error) {
	if len(in) == 0 {
		return nil, invalidf("scopes is required: give %q, %q or both", api.ScopeAdmin, api.ScopeUser)
	}
	if len(in) > maxTokenScopes {
		return nil, invalidf("scopes has %d entries; the scopes are %q and %q", len(in), api.ScopeAdmin, api.ScopeUser)
	}
	var out []string
	for _, sc := range in {
		if sc != api.ScopeAdmin && sc != api.ScopeUser {
			return nil, invalidf("scope %q is not known: use %q (hosts, networks, images, tokens) or %q (VMs, forks, placements, reads)",
				sc, api.ScopeAdmin, api.ScopeUser)
		}
		if slices.Contains(out, sc) {
			return nil, invalidf("scope %q is given twice", sc)
		}
		out = append(out, sc)
	}
	slices.Sort(out)
	return out, nil
}

func apiToken(r store.Token) api.Token {
	out := api.Token{ID: r.ID, Name: r.Name, Scopes: r.Scopes, ExpiresAt: r.ExpiresAt, LastUsedAt: r.LastUsedAt, CreatedAt: r.CreatedAt}
	if r.Project != nil {
		out.Project = *r.Project
	}
	return out
}
