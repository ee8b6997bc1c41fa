package httpapi_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	_ "github.com/glebarez/go-sqlite" // database/sql driver "sqlite", to read the table directly
	"github.com/jackc/pgx/v5"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestTokenLifecycle: a token is created (its secret shown once), used,
// listed with last_used_at, refused on a route its scope does not allow,
// revoked (the next request is 401); an expired token is 401; the database
// holds only digests. On SQLite and on PostgreSQL.
func TestTokenLifecycle(t *testing.T) {
	for _, db := range []string{store.DialectSQLite, store.DialectPostgres} {
		t.Run(db, func(t *testing.T) {
			opts := testenv.ControlOptions{}
			if db == store.DialectPostgres {
				opts.DatabaseURL = testenv.PostgresURL(t)
			}
			c := testenv.StartControl(t, opts)
			c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()

			later := time.Now().Add(time.Hour).UTC().Truncate(time.Second)
			user, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "ci", Scopes: []string{"user"}, ExpiresAt: &later})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(user.Secret, "kvmd_") || len(user.Secret) < 40 || user.ID == "" {
				t.Fatalf("created token: %+v", user)
			}
			admin, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "ops", Scopes: []string{"admin"}})
			if err != nil {
				t.Fatal(err)
			}
			uc := client.New(c.URL, user.Secret, client.WithRetries(0, 0))
			ac := client.New(c.URL, admin.Secret, client.WithRetries(0, 0))

			// Used within its scope.
			vm, err := uc.CreateVM(ctx, api.VMCreate{Name: "tok-vm", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, "")
			if err != nil {
				t.Fatalf("user token creating a VM: %v", err)
			}
			if _, err := uc.GetHost(ctx, "h1"); err != nil {
				t.Errorf("user token reading a host: %v", err)
			}
			// Refused outside it, with 403 forbidden and nothing changed.
			if _, err := uc.PutHost(ctx, "h2", api.HostPut{Address: "127.0.0.1:1"}); !errors.Is(err, client.ErrForbidden) {
				t.Errorf("user token registering a host: %v; want 403 forbidden", err)
			}
			if _, err := uc.CreateToken(ctx, api.TokenCreate{Name: "escalate", Scopes: []string{"admin"}}); !errors.Is(err, client.ErrForbidden) {
				t.Errorf("user token creating an admin token: %v; want 403 forbidden", err)
			}
			if err := ac.DeleteVM(ctx, vm.ID); !errors.Is(err, client.ErrForbidden) {
				t.Errorf("admin-only token deleting a VM: %v; want 403 forbidden", err)
			}
			if _, err := c.Client.GetVM(ctx, vm.ID); err != nil {
				t.Errorf("the VM after a refused delete: %v", err)
			}

			// Listed without secrets, with its use recorded.
			list, err := ac.ListTokens(ctx, client.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			byName := map[string]api.Token{}
			for _, tok := range list.Items {
				byName[tok.Name] = tok
				if tok.Secret != "" {
					t.Errorf("list shows the secret of %s", tok.Name)
				}
			}
			if got := byName["ci"]; got.ID != user.ID || got.LastUsedAt == nil || got.ExpiresAt == nil || !got.ExpiresAt.Equal(later) ||
				strings.Join(got.Scopes, ",") != "user" {
				t.Errorf("token ci in the list: %+v", got)
			}

			// Only digests in the database.
			rows := tokenRows(t, c, opts.DatabaseURL)
			if len(rows) != 2 {
				t.Fatalf("tokens table has %d rows, want 2", len(rows))
			}
			for _, secret := range []string{user.Secret, admin.Secret} {
				sum := sha256.Sum256([]byte(secret))
				found := false
				for _, row := range rows {
					if strings.Contains(row, secret) || strings.Contains(row, secret[len("kvmd_"):]) {
						t.Errorf("a token secret is stored in clear: %s", row)
					}
					found = found || strings.Contains(row, hex.EncodeToString(sum[:]))
				}
				if !found {
					t.Errorf("no row holds the SHA-256 of a created token: %v", rows)
				}
			}
			if db == store.DialectSQLite {
				for _, name := range []string{"kvmd.db", "kvmd.db-wal"} {
					b, err := os.ReadFile(filepath.Join(c.DataDir, name))
					if err != nil && !os.IsNotExist(err) {
						t.Fatal(err)
					}
					if bytes.Contains(b, []byte(user.Secret[len("kvmd_"):])) {
						t.Errorf("the secret is in the database file %s", name)
					}
				}
			}

			// Revoked: the next request is 401.
			if err := ac.RevokeToken(ctx, user.ID); err != nil {
				t.Fatal(err)
			}
			if _, err := uc.GetVM(ctx, vm.ID); !errors.Is(err, client.ErrUnauthorized) {
				t.Errorf("revoked token: %v; want 401", err)
			}
			if err := ac.RevokeToken(ctx, user.ID); !errors.Is(err, client.ErrNotFound) {
				t.Errorf("revoking twice: %v; want 404 not_found", err)
			}

			// Expired: 401. The row is written directly, as a token past its
			// expiry would be (the API refuses to create one).
			const expiredSecret = "kvmd_expired-secret-of-the-test-0123456789abcdefghij"
			sum := sha256.Sum256([]byte(expiredSecret))
			past := time.Now().Add(-time.Minute).UTC()
			if err := c.Store.InsertToken(ctx, store.Token{ID: "expired-1", Name: "old", SecretSHA256: hex.EncodeToString(sum[:]),
				Scopes: []string{"user", "admin"}, ExpiresAt: &past}); err != nil {
				t.Fatal(err)
			}
			if _, err := client.New(c.URL, expiredSecret, client.WithRetries(0, 0)).ListVMs(ctx, client.ListOptions{}); !errors.Is(err, client.ErrUnauthorized) {
				t.Errorf("expired token: %v; want 401", err)
			}

			// The bootstrap token keeps every scope.
			if _, err := c.Client.AllVMs(ctx, client.ListOptions{}); err != nil {
				t.Errorf("bootstrap token listing VMs: %v", err)
			}
			if _, err := c.Client.ListTokens(ctx, client.ListOptions{}); err != nil {
				t.Errorf("bootstrap token listing tokens: %v", err)
			}
		})
	}
}

// tokenRows reads every row of the tokens table as text, straight from the
// database (not through the store).
func tokenRows(t *testing.T, c *testenv.Control, databaseURL string) []string {
	t.Helper()
	ctx := context.Background()
	const q = "SELECT id, name, secret_sha256, scopes FROM tokens"
	var out []string
	if databaseURL != "" {
		conn, err := pgx.Connect(ctx, databaseURL)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close(ctx) }()
		rows, err := conn.Query(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var a, b, cc, d string
			if err := rows.Scan(&a, &b, &cc, &d); err != nil {
				t.Fatal(err)
			}
			out = append(out, strings.Join([]string{a, b, cc, d}, " | "))
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	db, err := sql.Open("sqlite", filepath.Join(c.DataDir, "kvmd.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var a, b, cc, d string
		if err := rows.Scan(&a, &b, &cc, &d); err != nil {
			t.Fatal(err)
		}
		out = append(out, strings.Join([]string{a, b, cc, d}, " | "))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTokenRevokeAcrossReplicas: two replicas on one PostgreSQL. A revoke
// on one is refused there at once, and on the other once its cache entry
// ages out (control.TokenCacheTTL).
func TestTokenRevokeAcrossReplicas(t *testing.T) {
	dsn := testenv.PostgresURL(t)
	a := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dsn})
	b := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dsn})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tok, err := a.Client.CreateToken(ctx, api.TokenCreate{Name: "shared", Scopes: []string{"user"}})
	if err != nil {
		t.Fatal(err)
	}
	onA := client.New(a.URL, tok.Secret, client.WithRetries(0, 0))
	onB := client.New(b.URL, tok.Secret, client.WithRetries(0, 0))
	for _, cl := range []*client.Client{onA, onB} { // both cache it
		if _, err := cl.ListVMs(ctx, client.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Client.RevokeToken(ctx, tok.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := onA.ListVMs(ctx, client.ListOptions{}); !errors.Is(err, client.ErrUnauthorized) {
		t.Fatalf("revoked token on the replica that revoked it: %v; want 401 at once", err)
	}
	deadline := time.Now().Add(control.TokenCacheTTL + 10*time.Second)
	for {
		_, err := onB.ListVMs(ctx, client.ListOptions{})
		if errors.Is(err, client.ErrUnauthorized) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the other replica still accepts the revoked token %s after the cache TTL", control.TokenCacheTTL)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestTokenChecksUseTheCache: many requests with one token read its row
// once (the cache), and an unknown kvmd_ secret is looked up once too.
func TestTokenChecksUseTheCache(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tok, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "hot", Scopes: []string{"user"}})
	if err != nil {
		t.Fatal(err)
	}
	before := c.Store.Statements()
	for i := range 50 {
		if r := send(t, c, "GET", "/v1/vms/none", "Bearer "+tok.Secret, nil, nil); r.status != http.StatusNotFound {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	// 50 GETs of a VM: 50 VM reads, at most one token read and one
	// last_used_at write (more would mean a lookup per request).
	if n := c.Store.Statements() - before; n > 52 {
		t.Errorf("50 requests with one token issued %d SQL statements; want at most 52", n)
	}
	before = c.Store.Statements()
	for range 20 {
		if r := send(t, c, "GET", "/v1/vms", "Bearer kvmd_unknown", nil, nil); r.status != http.StatusUnauthorized {
			t.Fatalf("unknown token: %d", r.status)
		}
	}
	if n := c.Store.Statements() - before; n > 1 {
		t.Errorf("20 requests with one unknown token issued %d SQL statements; want at most 1", n)
	}
}

// TestTokenCreateRefusals: bad token requests are 400 with a message that
// names the problem, and create nothing.
func TestTokenCreateRefusals(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	bearer := "Bearer " + c.Token
	for _, tt := range []struct{ body, want string }{
		{`{"scopes":["user"]}`, "name is required"},
		{`{"name":"bad name!","scopes":["user"]}`, `name "bad name!" is not valid`},
		{`{"name":"x"}`, "scopes is required"},
		{`{"name":"x","scopes":["root"]}`, `scope "root" is not known`},
		{`{"name":"x","scopes":["user","user"]}`, `scope "user" is given twice`},
		{`{"name":"x","scopes":["user","admin","user"]}`, "scopes has 3 entries"},
		{`{"name":"x","scopes":["user"],"expires_at":"2001-01-01T00:00:00Z"}`, "is not in the future"},
		{`{"name":"x","scopes":["user"],"expires_at":"tomorrow"}`, "invalid request body"},
		{`{"name":"x","scopes":["user"],"token":"kvmd_mine"}`, `unknown field "token"`},
		{`{"name":"x","scopes":"user"}`, `field "scopes" must be an array`},
	} {
		r := send(t, c, "POST", "/v1/tokens", bearer, strings.NewReader(tt.body), nil)
		if r.status != http.StatusBadRequest || r.env.Error.Code != "invalid" || !strings.Contains(r.env.Error.Message, tt.want) {
			t.Errorf("POST /v1/tokens %s: %d %s; want 400 invalid with %q", tt.body, r.status, r.body, tt.want)
		}
	}
	list, err := c.Client.ListTokens(context.Background(), client.ListOptions{})
	if err != nil || len(list.Items) != 0 {
		t.Errorf("refused requests made tokens: %+v %v", list.Items, err)
	}
}

// TestTokenCannotMintScopesItLacks: admin does not imply user (writes of
// VMs, forks and placements are user only), so an admin-only token must
// not make itself a user token; it may make admin tokens. The bootstrap
// token holds both scopes and may make any.
func TestTokenCannotMintScopesItLacks(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "ops", Scopes: []string{"admin"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, scopes := range []string{`["user"]`, `["admin","user"]`} {
		r := send(t, c, "POST", "/v1/tokens", "Bearer "+admin.Secret, strings.NewReader(`{"name":"escalate","scopes":`+scopes+`}`), nil)
		if r.status != http.StatusForbidden || r.env.Error.Code != "forbidden" || !strings.Contains(r.env.Error.Message, `scope "user"`) {
			t.Errorf("admin-only token creating a token with scopes %s: %d %s; want 403 forbidden naming scope \"user\"", scopes, r.status, r.body)
		}
	}
	r := send(t, c, "POST", "/v1/tokens", "Bearer "+admin.Secret, strings.NewReader(`{"name":"ops2","scopes":["admin"]}`), nil)
	if r.status != http.StatusCreated {
		t.Errorf("admin-only token creating an admin token: %d %s; want 201", r.status, r.body)
	}
	if _, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "both", Scopes: []string{"admin", "user"}}); err != nil {
		t.Errorf("bootstrap token creating an admin and user token: %v", err)
	}
	list, err := c.Client.ListTokens(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range list.Items {
		if tok.Name == "escalate" {
			t.Errorf("a refused request made token %+v", tok)
		}
	}
}
