package httpapi

import (
	"cmp"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpserver"
)

// The fleet page (/ui): a read-only, server-rendered view of hosts, VMs,
// forks and warm pools for people. A browser cannot easily send a bearer
// header, so the page takes an API token once (a login form, or ?token= in
// the URL) and answers with an HttpOnly session cookie. Any valid token
// will do, whatever its scopes: the page only reads. The cookie holds an
// expiry, a random session id, the SHA-256 of the token (what the database
// keeps, never the token itself, so it cannot be replayed against /v1) and
// an HMAC keyed by the bootstrap token; every view checks the token again,
// so a session ends when its token is revoked or expires, and all sessions
// end when the bootstrap token changes. Signing out records the session id
// in the database, so that a copy of the cookie stops working on every
// replica too.
//
// The login and logout forms refuse cross-origin posts (Go's
// http.CrossOriginProtection: Sec-Fetch-Site, else Origin against Host; a
// request with neither, from curl or a script, is no browser's and passes),
// so another site cannot sign a visitor in as someone else or out.

//go:embed ui/*.html.tmpl
var uiFiles embed.FS

const (
	uiCookie = "kvmd_ui"
	// uiSessionTTL is how long a session cookie is good for.
	uiSessionTTL = 12 * time.Hour
	// uiMaxHosts and uiMaxVMs bound the work of one page view; a larger
	// fleet shows the first ones and says that the list is cut.
	uiMaxHosts = 1000
	uiMaxVMs   = 5000
	uiMaxForks = 200
	// uiMaxProjects bounds the projects a page view lists.
	uiMaxProjects = 1000
)

var uiTemplates = template.Must(template.New("ui").Funcs(template.FuncMap{
	"gib":      func(mib int64) string { return strconv.FormatFloat(float64(mib)/1024, 'f', 1, 64) },
	"score":    func(f float64) string { return strconv.FormatFloat(f, 'f', 3, 64) },
	"termList": termList,
	"count":    count,
}).ParseFS(uiFiles, "ui/*.html.tmpl"))

// uiAuth issues and checks the fleet page's session cookies.
type uiAuth struct {
	tokens tokens
	key    string // the bootstrap token: the sessions' HMAC key
	now    func() time.Time
}

// uiSession is a valid session cookie's content.
type uiSession struct {
	id      string
	expires time.Time
	// who holds the session's token: the page shows what it may see.
	who control.Principal
}

// login returns the digest a session keeps for a token secret, or false
// when the token is not valid. err is a failure to check it.
func (a uiAuth) login(c echo.Context, secret string) (string, bool, error) {
	if secret == "" {
		return "", false, nil
	}
	if _, err := a.tokens.authenticate(c.Request().Context(), secret); err != nil {
		if isUnauthorized(err) {
			return "", false, nil
		}
		return "", false, err
	}
	sum := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(sum[:]), true, nil
}

func (a uiAuth) mac(expiry, id, digest string) string {
	m := hmac.New(sha256.New, []byte(a.key))
	m.Write([]byte("kvmd-ui-session|" + expiry + "|" + id + "|" + digest))
	return hex.EncodeToString(m.Sum(nil))
}

func (a uiAuth) cookie(c echo.Context, digest string) (*http.Cookie, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, &control.Error{Code: api.CodeInternal, Message: "make a fleet page session id", Err: err}
	}
	id := hex.EncodeToString(b[:])
	exp := a.now().Add(uiSessionTTL)
	e := strconv.FormatInt(exp.Unix(), 10)
	return &http.Cookie{
		Name: uiCookie, Value: e + "." + id + "." + digest + "." + a.mac(e, id, digest), Path: "/ui", Expires: exp,
		MaxAge: int(uiSessionTTL.Seconds()), HttpOnly: true, Secure: c.Scheme() == "https", SameSite: http.SameSiteStrictMode,
	}, nil
}

// session returns the request's session when its cookie is one this
// server issued, not expired nor signed out, for a token that is still
// valid.
func (a uiAuth) session(c echo.Context) (uiSession, bool, error) {
	ck, err := c.Cookie(uiCookie)
	if err != nil {
		return uiSession{}, false, nil
	}
	parts := strings.Split(ck.Value, ".")
	if len(parts) != 4 {
		return uiSession{}, false, nil
	}
	e, id, digest, mac := parts[0], parts[1], parts[2], parts[3]
	exp, err := strconv.ParseInt(e, 10, 64)
	if err != nil || a.now().Unix() >= exp || !hmac.Equal([]byte(mac), []byte(a.mac(e, id, digest))) {
		return uiSession{}, false, nil
	}
	ctx := c.Request().Context()
	who, err := a.tokens.authenticateDigest(ctx, digest)
	if err != nil {
		if isUnauthorized(err) {
			return uiSession{}, false, nil
		}
		return uiSession{}, false, err
	}
	ended, err := a.tokens.svc.UISessionEnded(ctx, id)
	if err != nil || ended {
		return uiSession{}, false, err
	}
	return uiSession{id: id, expires: time.Unix(exp, 0), who: who}, true, nil
}

// bearer says whether the request carries a valid token in its
// Authorization header (curl and scripts may use the page like the API).
func (a uiAuth) bearer(c echo.Context) (control.Principal, bool, error) {
	secret, ok := httpserver.BearerToken(c.Request())
	if !ok || secret == "" {
		return control.Principal{}, false, nil
	}
	who, err := a.tokens.authenticate(c.Request().Context(), secret)
	if err != nil {
		if isUnauthorized(err) {
			return control.Principal{}, false, nil
		}
		return control.Principal{}, false, err
	}
	return who, true, nil
}

// signedIn says who the request's session or bearer token belongs to, if
// it has one.
func (a uiAuth) signedIn(c echo.Context) (control.Principal, bool, error) {
	if sess, ok, err := a.session(c); ok || err != nil {
		return sess.who, ok, err
	}
	return a.bearer(c)
}

type uiHandlers struct {
	svc  *control.Service
	auth uiAuth
}

func (h *handlers) uiRoutes(e *echo.Echo, toks tokens, bootstrap string) {
	u := &uiHandlers{svc: h.svc, auth: uiAuth{tokens: toks, key: bootstrap, now: time.Now}}
	sameOrigin := sameOriginForms(http.NewCrossOriginProtection())
	e.GET("/ui", u.fleet)
	e.POST("/ui/login", u.login, sameOrigin)
	e.POST("/ui/logout", u.logout, sameOrigin)
}

// sameOriginForms refuses a cross-origin browser post with 403 before the
// handler runs (see the comment at the top).
func sameOriginForms(cop *http.CrossOriginProtection) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if err := cop.Check(c.Request()); err != nil {
				uiHeaders(c)
				return &control.Error{Code: api.CodeForbidden, Err: err,
					Message: "refused a cross-origin post to " + c.Path() + ": sign in and out from the fleet page itself, " +
						"at this server's own address (a proxy in front must pass the Host header on)"}
			}
			return next(c)
		}
	}
}

func uiHeaders(c echo.Context) {
	hd := c.Response().Header()
	hd.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("Cache-Control", "no-store")
}

func (u *uiHandlers) render(c echo.Context, status int, name string, data any) error {
	uiHeaders(c)
	var b strings.Builder
	if err := uiTemplates.ExecuteTemplate(&b, name, data); err != nil {
		return &control.Error{Code: api.CodeInternal, Message: "render the fleet page", Err: err}
	}
	return c.HTML(status, b.String())
}

// loginPage answers 401 with the login form.
func (u *uiHandlers) loginPage(c echo.Context, msg string) error {
	c.Response().Header().Set(echo.HeaderWWWAuthenticate, `Bearer realm="kvmd"`)
	return u.render(c, http.StatusUnauthorized, "login.html.tmpl", map[string]string{"Message": msg})
}

// badTokenMessage is the login page's answer to a token that is not valid.
const badTokenMessage = "That token is not the control API's token, nor a valid token of its own (it is unknown, revoked or expired)."

func (u *uiHandlers) fleet(c echo.Context) error {
	if tok := c.QueryParam("token"); tok != "" {
		digest, ok, err := u.auth.login(c, tok)
		if err != nil {
			return err
		}
		if !ok {
			return u.loginPage(c, badTokenMessage)
		}
		// Trade the token in the URL for a cookie, and drop it from the
		// address bar and the history.
		ck, err := u.auth.cookie(c, digest)
		if err != nil {
			return err
		}
		c.SetCookie(ck)
		uiHeaders(c)
		return c.Redirect(http.StatusSeeOther, "/ui")
	}
	who, ok, err := u.auth.signedIn(c)
	if err != nil || !ok {
		if err != nil {
			return err
		}
		return u.loginPage(c, "")
	}
	// A project token's page shows its project alone.
	c.SetRequest(c.Request().WithContext(control.WithPrincipal(c.Request().Context(), who)))
	view, err := u.view(c)
	if err != nil {
		return err
	}
	return u.render(c, http.StatusOK, "fleet.html.tmpl", view)
}

func (u *uiHandlers) login(c echo.Context) error {
	secret := c.FormValue("token")
	if secret == "" {
		secret, _ = httpserver.BearerToken(c.Request())
	}
	digest, ok, err := u.auth.login(c, secret)
	if err != nil {
		return err
	}
	if !ok {
		return u.loginPage(c, badTokenMessage)
	}
	ck, err := u.auth.cookie(c, digest)
	if err != nil {
		return err
	}
	c.SetCookie(ck)
	uiHeaders(c)
	return c.Redirect(http.StatusSeeOther, "/ui")
}

func (u *uiHandlers) logout(c echo.Context) error {
	sess, ok, err := u.auth.session(c)
	if err != nil {
		return err
	}
	if ok {
		// Server-side: a copy of this cookie must not outlive the sign-out.
		if err := u.svc.EndUISession(c.Request().Context(), sess.id, sess.expires); err != nil {
			return err
		}
	} else if _, ok, err := u.auth.bearer(c); err != nil || !ok {
		if err != nil {
			return err
		}
		return u.loginPage(c, "")
	}
	c.SetCookie(&http.Cookie{Name: uiCookie, Value: "", Path: "/ui", MaxAge: -1, HttpOnly: true,
		Secure: c.Scheme() == "https", SameSite: http.SameSiteStrictMode})
	uiHeaders(c)
	return c.Redirect(http.StatusSeeOther, "/ui")
}

// usage is one capacity bar: allocated out of what the scheduler may hand
// out (capacity times the allocation ratio, less reserved memory).
type usage struct {
	Used, Total int64
	Pct         int
}

func usageOf(allocated, free int64) usage {
	total := allocated + max(free, 0)
	u := usage{Used: allocated, Total: total}
	if total > 0 {
		u.Pct = int(min(100, allocated*100/total))
	}
	return u
}

type uiHost struct {
	api.Host
	CPU, Memory, Disk usage
	VMs               int
}

// quotaBar is one resource of a project: its usage against its quota, or
// its usage alone where the resource is unlimited.
type quotaBar struct {
	Used, Limit int64
	Limited     bool
	// High is 90% of the quota, where the meter turns (and
	// KvmdProjectNearQuota fires); Pct may pass 100 when a quota was
	// lowered below the usage. Both are 0 for a quota of 0.
	High, Pct int64
	Text      string // "2 / 4" or "1.0 / 4.0 GiB"; the usage alone when unlimited
}

func quotaOf(used int64, limit *int64, mib bool) quotaBar {
	format := func(n int64) string { return strconv.FormatInt(n, 10) }
	unit := ""
	if mib {
		format = func(n int64) string { return strconv.FormatFloat(float64(n)/1024, 'f', 1, 64) }
		unit = " GiB"
	}
	if limit == nil {
		return quotaBar{Used: used, Text: format(used) + unit}
	}
	q := quotaBar{Used: used, Limit: *limit, Limited: true, Text: format(used) + " / " + format(*limit) + unit}
	if *limit > 0 {
		q.High, q.Pct = *limit*9/10, used*100 / *limit
	}
	return q
}

type uiProject struct {
	api.Project
	VCPUs, Memory, Disk, VMs quotaBar
}

type uiWarmPool struct {
	Host string
	api.WarmPoolTarget
}

type uiFork struct {
	api.Fork
	States map[string]int
}

type fleetView struct {
	Generated time.Time
	Hosts     []uiHost
	Projects  []uiProject
	VMs       []api.VM
	Forks     []uiFork
	WarmPools []uiWarmPool
	States    []stateCount
	HostsCut  bool
	VMsCut    bool
	ForksCut  bool
	// ProjectsCut says the list stops at uiMaxProjects.
	ProjectsCut bool
	AliveHosts  int
}

type stateCount struct {
	State string
	N     int
}

func (u *uiHandlers) view(c echo.Context) (fleetView, error) {
	ctx := c.Request().Context()
	v := fleetView{Generated: time.Now().UTC()}
	var hosts []api.Host
	for page := (control.Page{Size: api.MaxPageSize}); ; {
		l, err := u.svc.ListHosts(ctx, page)
		if err != nil {
			return v, err
		}
		hosts = append(hosts, l.Items...)
		if l.NextPageToken == "" {
			break
		}
		if len(hosts) >= uiMaxHosts {
			v.HostsCut = true
			break
		}
		page.Token = l.NextPageToken
	}
	q := control.VMQuery{Page: control.Page{Size: api.MaxPageSize}}
	for {
		l, err := u.svc.ListVMs(ctx, q)
		if err != nil {
			return v, err
		}
		v.VMs = append(v.VMs, l.Items...)
		if l.NextPageToken == "" {
			break
		}
		if len(v.VMs) >= uiMaxVMs {
			v.VMsCut = true
			break
		}
		q.Token = l.NextPageToken
	}

	// The caller's projects: all for a fleet-wide token, its own for a
	// project token (the request carries its principal).
	for page := (control.Page{Size: api.MaxPageSize}); ; {
		l, err := u.svc.ListProjects(ctx, page)
		if err != nil {
			return v, err
		}
		for _, p := range l.Items {
			v.Projects = append(v.Projects, uiProject{Project: p,
				VCPUs:  quotaOf(p.Usage.VCPUs, p.Quotas.VCPUs, false),
				Memory: quotaOf(p.Usage.MemoryMiB, p.Quotas.MemoryMiB, true),
				Disk:   quotaOf(p.Usage.DiskMiB, p.Quotas.DiskMiB, true),
				VMs:    quotaOf(p.Usage.VMs, p.Quotas.VMs, false),
			})
		}
		if l.NextPageToken == "" {
			break
		}
		if len(v.Projects) >= uiMaxProjects {
			v.ProjectsCut = true
			break
		}
		page.Token = l.NextPageToken
	}

	perHost := map[string]int{}
	states := map[string]int{}
	var forkIDs []string
	for _, vm := range v.VMs {
		perHost[vm.Host]++
		states[vm.ObservedState]++
		if vm.ForkID != "" && !slices.Contains(forkIDs, vm.ForkID) {
			forkIDs = append(forkIDs, vm.ForkID)
		}
	}
	for s, n := range states {
		v.States = append(v.States, stateCount{s, n})
	}
	slices.SortFunc(v.States, func(a, b stateCount) int { return cmp.Compare(a.State, b.State) })

	for _, h := range hosts {
		if h.Alive {
			v.AliveHosts++
		}
		v.Hosts = append(v.Hosts, uiHost{
			Host: h, VMs: perHost[h.Name],
			// Against the capacity: free also leaves out the warm pool.
			CPU:    usageOf(h.Allocated.VCPUs, h.Capacity.VCPUs-h.Allocated.VCPUs),
			Memory: usageOf(h.Allocated.MemoryMiB, h.Capacity.MemoryMiB-h.Allocated.MemoryMiB),
			Disk:   usageOf(h.Allocated.DiskMiB, h.Capacity.DiskMiB-h.Allocated.DiskMiB),
		})
		for _, w := range h.WarmPool {
			v.WarmPools = append(v.WarmPools, uiWarmPool{Host: h.Name, WarmPoolTarget: w})
		}
	}

	if len(forkIDs) > uiMaxForks {
		forkIDs, v.ForksCut = forkIDs[:uiMaxForks], true
	}
	for _, id := range forkIDs {
		f, err := u.svc.GetFork(ctx, id)
		if err != nil {
			// A fork deleted between the two reads: its children go with it.
			continue
		}
		uf := uiFork{Fork: f, States: map[string]int{}}
		for _, ch := range f.Children {
			uf.States[ch.ObservedState]++
		}
		v.Forks = append(v.Forks, uf)
	}
	return v, nil
}

// count says "1 host" or "2 hosts".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

// termList renders a placement's score terms in a stable order.
func termList(terms map[string]float64) string {
	keys := make([]string, 0, len(terms))
	for k := range terms {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.3f", k, terms[k]))
	}
	return strings.Join(parts, ", ")
}
