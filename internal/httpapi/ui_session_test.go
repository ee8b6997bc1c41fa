package httpapi_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// post sends a form to the fleet page with the given headers.
func post(t *testing.T, hc *http.Client, u string, form url.Values, header map[string]string) *http.Response {
	t.Helper()
	h := map[string]string{"Content-Type": "application/x-www-form-urlencoded"}
	for k, v := range header {
		h[k] = v
	}
	return sendPage(t, hc, http.MethodPost, u, strings.NewReader(form.Encode()), h)
}

func sessionCookie(r *http.Response) *http.Cookie {
	for _, ck := range r.Cookies() {
		if ck.Name == "kvmd_ui" && ck.Value != "" {
			return ck
		}
	}
	return nil
}

// TestFleetPageRefusesCrossSiteForms: a page of another site cannot post
// the login or logout form (login CSRF would sign the victim in as the
// attacker; logout CSRF would end sessions): a foreign Origin or
// Sec-Fetch-Site: cross-site is 403 and sets no cookie. The page's own
// form (same origin) and clients that send neither header (curl,
// scripts) work.
func TestFleetPageRefusesCrossSiteForms(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{NoMonitor: true})
	hc := noRedirects()
	u, err := url.Parse(c.URL)
	if err != nil {
		t.Fatal(err)
	}
	form := url.Values{"token": {c.Token}}
	for name, h := range map[string]map[string]string{
		"foreign Origin":            {"Origin": "https://evil.example"},
		"foreign Origin, same host": {"Origin": "http://" + u.Hostname() + ":1"},
		"Sec-Fetch-Site cross-site": {"Sec-Fetch-Site": "cross-site"},
		"Sec-Fetch-Site same-site":  {"Sec-Fetch-Site": "same-site", "Origin": "http://sub." + u.Host},
		"null Origin":               {"Origin": "null"},
	} {
		if r := post(t, hc, c.URL+"/ui/login", form, h); r.StatusCode != http.StatusForbidden || sessionCookie(r) != nil {
			t.Errorf("%s: POST /ui/login = %d with cookie %v; want 403 and no cookie", name, r.StatusCode, sessionCookie(r))
		}
	}
	for name, h := range map[string]map[string]string{
		"same Origin":                {"Origin": c.URL},
		"Sec-Fetch-Site same-origin": {"Sec-Fetch-Site": "same-origin", "Origin": c.URL},
		"neither header (curl)":      nil,
	} {
		r := post(t, hc, c.URL+"/ui/login", form, h)
		ck := sessionCookie(r)
		if r.StatusCode != http.StatusSeeOther || ck == nil {
			t.Errorf("%s: POST /ui/login = %d with cookie %v; want 303 and a session cookie", name, r.StatusCode, ck)
			continue
		}
		cross := map[string]string{"Cookie": ck.String(), "Origin": "https://evil.example"}
		if r := post(t, hc, c.URL+"/ui/logout", nil, cross); r.StatusCode != http.StatusForbidden {
			t.Errorf("%s: POST /ui/logout from a foreign Origin = %d; want 403", name, r.StatusCode)
		}
		if r := get(t, hc, c.URL+"/ui", map[string]string{"Cookie": ck.String()}); r.StatusCode != http.StatusOK {
			t.Errorf("%s: GET /ui after a refused cross-site logout = %d; want 200 (the session goes on)", name, r.StatusCode)
		}
	}
}

// TestFleetPageLogoutEndsTheSession: signing out ends the session on the
// server, not only in the browser: the same cookie replayed afterwards (a
// stolen copy) is 401, on this replica and on another one sharing the
// database. Other sessions of the same token go on. On SQLite (two
// replicas on one file) and on PostgreSQL.
func TestFleetPageLogoutEndsTheSession(t *testing.T) {
	for _, db := range []string{store.DialectSQLite, store.DialectPostgres} {
		t.Run(db, func(t *testing.T) {
			opts := testenv.ControlOptions{NoMonitor: true, DataDir: t.TempDir()}
			if db == store.DialectPostgres {
				opts.DatabaseURL = testenv.PostgresURL(t)
			}
			a := testenv.StartControl(t, opts)
			b := testenv.StartControl(t, opts)
			hc := noRedirects()
			login := func() *http.Cookie {
				t.Helper()
				r := post(t, hc, a.URL+"/ui/login", url.Values{"token": {a.Token}}, map[string]string{"Origin": a.URL})
				ck := sessionCookie(r)
				if r.StatusCode != http.StatusSeeOther || ck == nil {
					t.Fatalf("POST /ui/login = %d with cookie %v; want 303 and a session cookie", r.StatusCode, ck)
				}
				return ck
			}
			stolen, other := login(), login()
			for _, base := range []string{a.URL, b.URL} {
				if r := get(t, hc, base+"/ui", map[string]string{"Cookie": stolen.String()}); r.StatusCode != http.StatusOK {
					t.Fatalf("GET %s/ui with the session cookie = %d; want 200", base, r.StatusCode)
				}
			}
			r := post(t, hc, a.URL+"/ui/logout", nil, map[string]string{"Cookie": stolen.String(), "Origin": a.URL})
			if r.StatusCode != http.StatusSeeOther {
				t.Fatalf("POST /ui/logout = %d; want 303", r.StatusCode)
			}
			for _, base := range []string{a.URL, b.URL} {
				if r := get(t, hc, base+"/ui", map[string]string{"Cookie": stolen.String()}); r.StatusCode != http.StatusUnauthorized {
					t.Errorf("GET %s/ui with the cookie of a session that signed out = %d; want 401", base, r.StatusCode)
				}
				if r := get(t, hc, base+"/ui", map[string]string{"Cookie": other.String()}); r.StatusCode != http.StatusOK {
					t.Errorf("GET %s/ui with another session of the same token = %d; want 200", base, r.StatusCode)
				}
			}
		})
	}
}
