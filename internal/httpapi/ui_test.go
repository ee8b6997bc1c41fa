package httpapi_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// fleetEnv is a control API with two sim hosts and VMs in several states:
// web-1 running on h1, web-2 stopped, gone deleted behind the control
// API's back (so missing), a fork of web-1 with two children, and a warm
// pool of two on h2.
type fleetEnv struct {
	c      *testenv.Control
	forkID string
}

func startFleet(t *testing.T) fleetEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a1 := testenv.StartAgent(t, testenv.AgentOptions{})
	a2 := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h1", a1.Address)
	if _, err := c.Client.PutHost(ctx, "h2", api.HostPut{Address: a2.Address, WarmPool: []api.WarmPoolTarget{
		{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 512, Size: 2},
	}}); err != nil {
		t.Fatal(err)
	}
	create := func(name, host, power string) api.VM {
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 2048,
			Host: host, PowerState: power}, "")
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		return vm
	}
	web1 := create("web-1", "h1", "")
	create("web-2", "", api.PowerStopped)
	gone := create("gone", "h1", "")
	if err := a1.Client.DeleteVM(ctx, gone.ID); err != nil {
		t.Fatalf("delete gone on its agent: %v", err)
	}
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: web1.ID, Count: 2, Placement: api.PlacementColocate}, "")
	if err != nil {
		t.Fatalf("fork web-1: %v", err)
	}
	// Wait (bounded) until the monitor has seen gone missing and the warm
	// pool is full, so that the page has settled states to show.
	for i := 0; ; i++ {
		g, err := c.Client.GetVM(ctx, gone.ID)
		if err != nil {
			t.Fatal(err)
		}
		h2, err := c.Client.GetHost(ctx, "h2")
		if err != nil {
			t.Fatal(err)
		}
		if g.ObservedState == api.StateMissing && len(h2.WarmPool) == 1 && h2.WarmPool[0].Ready == 2 {
			break
		}
		if i == 300 {
			t.Fatalf("after 300 rounds: gone is %s, h2's warm pool %+v", g.ObservedState, h2.WarmPool)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fleetEnv{c: c, forkID: f.ID}
}

func noRedirects() *http.Client {
	return &http.Client{Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
}

func get(t *testing.T, hc *http.Client, u string, header map[string]string) *http.Response {
	t.Helper()
	return sendPage(t, hc, http.MethodGet, u, nil, header)
}

// sendPage makes one request with the given headers and returns the answer,
// its body read and closed.
func sendPage(t *testing.T, hc *http.Client, method, u string, body io.Reader, header map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp
}

// The page's access rules over plain HTTP: no token 401, a wrong token 401,
// ?token= trades the token for an HttpOnly cookie and a redirect that drops
// it from the URL, the cookie opens the page, a tampered one does not, and
// the cookie is no API token.
func TestFleetPageAuth(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	hc := noRedirects()
	for name, h := range map[string]map[string]string{
		"no token":          nil,
		"wrong bearer":      {"Authorization": "Bearer nope"},
		"forged cookie":     {"Cookie": "kvmd_ui=99999999999.deadbeef"},
		"token as a cookie": {"Cookie": "kvmd_ui=" + c.Token},
	} {
		if r := get(t, hc, c.URL+"/ui", h); r.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s: GET /ui = %d, want 401", name, r.StatusCode)
		}
	}
	if r := get(t, hc, c.URL+"/ui?token=wrong", nil); r.StatusCode != http.StatusUnauthorized || len(r.Cookies()) != 0 {
		t.Errorf("GET /ui?token=wrong = %d with cookies %v, want 401 and none", r.StatusCode, r.Cookies())
	}
	if r := get(t, hc, c.URL+"/ui", map[string]string{"Authorization": "Bearer " + c.Token}); r.StatusCode != http.StatusOK {
		t.Errorf("GET /ui with the bearer token = %d, want 200", r.StatusCode)
	}

	r := get(t, hc, c.URL+"/ui?token="+url.QueryEscape(c.Token), nil)
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != "/ui" {
		t.Fatalf("GET /ui?token= = %d to %q, want 303 to /ui", r.StatusCode, r.Header.Get("Location"))
	}
	var session *http.Cookie
	for _, ck := range r.Cookies() {
		if ck.Name == "kvmd_ui" {
			session = ck
		}
	}
	if session == nil || !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || strings.Contains(session.Value, c.Token) {
		t.Fatalf("session cookie %+v: want HttpOnly, SameSite=Strict, not holding the token", session)
	}
	if r := get(t, hc, c.URL+"/ui", map[string]string{"Cookie": session.String()}); r.StatusCode != http.StatusOK {
		t.Errorf("GET /ui with the session cookie = %d, want 200", r.StatusCode)
	}
	exp, mac, _ := strings.Cut(session.Value, ".")
	longer := "9" + exp + "." + mac
	if r := get(t, hc, c.URL+"/ui", map[string]string{"Cookie": "kvmd_ui=" + longer}); r.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /ui with a cookie whose expiry was pushed out = %d, want 401", r.StatusCode)
	}
	if r := get(t, hc, c.URL+"/v1/hosts", map[string]string{"Cookie": session.String()}); r.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /v1/hosts with the UI cookie = %d, want 401 (the cookie is no API credential)", r.StatusCode)
	}
	if r := get(t, hc, c.URL+"/v1/hosts", map[string]string{"Authorization": "Bearer " + session.Value}); r.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /v1/hosts with the cookie's value as bearer = %d, want 401", r.StatusCode)
	}
}

// chromium finds Debian's chromium (or KVM_CHROMIUM); without one the test
// skips, unless KVM_REQUIRE_BROWSER=1 (CI) makes it fail.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("KVM_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "no chromium on PATH, so the fleet page's browser test skips; scripts/deps.sh ci installs it (apt-get install chromium)"
	if os.Getenv("KVM_REQUIRE_BROWSER") == "1" {
		t.Fatal(msg + " (KVM_REQUIRE_BROWSER=1: failing instead)")
	}
	t.Skip(msg)
	return ""
}

// TestFleetPageInHeadlessChromium signs in through the login form in a real
// headless Chromium and reads what a person would see: the hosts with their
// allocation bars, the VMs with their states and placement, the fork and
// the warm pool, the projects against their quotas. The session cookie is
// HttpOnly (scripts cannot read it).
func TestFleetPageInHeadlessChromium(t *testing.T) {
	exe := chromium(t)
	e := startFleet(t)
	createProjectHTTP(t, e.c, `{"name":"team-a","quotas":{"vcpus":8}}`)

	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	ctx, cancel := context.WithTimeout(bctx, 2*time.Minute)
	defer cancel()

	// text reads the visible text of the first element matching a CSS selector.
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel), chromedp.NodeVisible))
		if err != nil {
			t.Fatalf("read %s: %v", sel, err)
		}
		return s
	}
	attr := func(sel, name string) string {
		t.Helper()
		a, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(sel), name))
		if err != nil || !a.Exists {
			t.Fatalf("attribute %s of %s: %v (exists %v)", name, sel, err, a.Exists)
		}
		return a.Value
	}
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	signIn := func(token string) {
		t.Helper()
		do("sign in",
			chromedp.SendKeys(chromedp.CSS(`input[name=token]`), token),
			chromedp.Click(chromedp.CSS(`button[type=submit]`)))
	}

	do("open /ui", chromedp.Navigate(e.c.URL+"/ui"), chromedp.WaitVisible(chromedp.CSS(`input[name=token]`)))
	login := text(`body`)
	signIn("not-the-token")
	do("wait for the error", chromedp.WaitVisible(chromedp.CSS(`#login-error`)))
	loginErr := text(`#login-error`)
	if !strings.Contains(login, "needs the control API's token") || !strings.Contains(loginErr, "not the control API's token") {
		t.Fatalf("login page says %q, after a wrong token %q", login, loginErr)
	}

	signIn(e.c.Token)
	do("wait for the fleet", chromedp.WaitVisible(chromedp.CSS(`#hosts`)))
	summary := text(`#summary`)
	h1, h2 := text(`#host-h1`), text(`#host-h2`)
	h1CPU, h1Max := attr(`#host-h1 meter`, "value"), attr(`#host-h1 meter`, "max")
	web1, web2, gone := text(`#vm-web-1`), text(`#vm-web-2`), text(`#vm-gone`)
	fork := text(`#fork-` + e.forkID)
	warm := text(`#warm-pools tbody tr`)
	teamA, teamAMemory := text(`#project-team-a`), text(`#project-team-a td.memory_mib`)
	teamAMax, teamAValue := attr(`#project-team-a td.vcpus meter`, "max"), attr(`#project-team-a td.vcpus meter`, "value")
	defaultVMs := text(`#project-default td.vms`)
	cookie, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.cookie`))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("summary: %s", summary)
	ctxH, cancelH := context.WithTimeout(context.Background(), time.Minute)
	defer cancelH()
	hostH1, err := e.c.Client.GetHost(ctxH, "h1")
	if err != nil {
		t.Fatal(err)
	}
	wantCPU := hostH1.Allocated.VCPUs
	var def api.Project
	if r := send(t, e.c, http.MethodGet, "/v1/projects/default", "Bearer "+e.c.Token, nil, nil); r.status != http.StatusOK ||
		json.Unmarshal(r.body, &def) != nil {
		t.Fatalf("GET /v1/projects/default: %d %s", r.status, r.body)
	}
	checks := []struct {
		what, got string
		want      []string
	}{
		{"summary", summary, []string{"2 hosts (2 alive)", "5 VMs", "1 missing", "1 stopped", "3 running"}},
		{"host h1", h1, []string{"h1", "alive", "sim"}},
		{"host h2", h2, []string{"h2", "alive"}},
		{"VM web-1", web1, []string{"web-1", "running", "h1", "2 vCPU, 1024 MiB", "score"}},
		{"VM web-2", web2, []string{"web-2", "stopped", "score"}},
		{"VM gone", gone, []string{"gone", "missing", "h1"}},
		{"fork", fork, []string{e.forkID, "ready", "2 of 2", "2 running", "colocate"}},
		{"warm pool", warm, []string{"h2", "sim", "1 vCPU, 256 MiB", "2 of 2 ready"}},
		{"project team-a", teamA, []string{"team-a", "0 / 8 (0%)"}},
		{"team-a's memory", teamAMemory, []string{"unlimited"}},
		{"default's VMs", defaultVMs, []string{itoa(def.Usage.VMs), "unlimited"}},
	}
	for _, ch := range checks {
		for _, w := range ch.want {
			if !strings.Contains(ch.got, w) {
				t.Errorf("%s shows %q, want it to contain %q", ch.what, ch.got, w)
			}
		}
	}
	if h1CPU != itoa(wantCPU) || h1Max == "" || h1Max == "0" {
		t.Errorf("h1's vCPU bar: value %q max %q, want value %d (allocated) of a positive max", h1CPU, h1Max, wantCPU)
	}
	if !strings.Contains(h1, itoa(wantCPU)+" / "+h1Max) {
		t.Errorf("h1 shows %q, want its vCPU allocation %d / %s", h1, wantCPU, h1Max)
	}
	if teamAMax != "8" || teamAValue != "0" {
		t.Errorf("team-a's vCPU bar: value %q max %q, want 0 of 8", teamAValue, teamAMax)
	}
	if strings.Contains(cookie, "kvmd_ui") {
		t.Errorf("document.cookie = %q: the session cookie must be HttpOnly", cookie)
	}

	// Signing out ends the session: the page asks for the token again.
	do("sign out", chromedp.Click(chromedp.CSS(`form[action="/ui/logout"] button`)),
		chromedp.WaitVisible(chromedp.CSS(`input[name=token]`)))
	if after := text(`body`); !strings.Contains(after, "needs the control API's token") {
		t.Errorf("after signing out the page says %q, want the login form", after)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// Any valid token of the database opens the fleet page, whatever its
// scopes (the page only reads), as a bearer token and through a session;
// the session ends when its token is revoked, and a revoked token signs
// in no more.
func TestFleetPageTakesAnyValidToken(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ctx := context.Background()
	hc := noRedirects()
	for _, scopes := range [][]string{{api.ScopeUser}, {api.ScopeAdmin}, {api.ScopeAdmin, api.ScopeUser}} {
		name := strings.Join(scopes, "-")
		tok, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "ui-" + name, Scopes: scopes})
		if err != nil {
			t.Fatal(err)
		}
		if r := get(t, hc, c.URL+"/ui", map[string]string{"Authorization": "Bearer " + tok.Secret}); r.StatusCode != http.StatusOK {
			t.Errorf("%s token: GET /ui as bearer = %d, want 200", name, r.StatusCode)
		}
		r := get(t, hc, c.URL+"/ui?token="+url.QueryEscape(tok.Secret), nil)
		var session *http.Cookie
		for _, ck := range r.Cookies() {
			if ck.Name == "kvmd_ui" {
				session = ck
			}
		}
		if r.StatusCode != http.StatusSeeOther || session == nil || strings.Contains(session.Value, tok.Secret) {
			t.Fatalf("%s token: GET /ui?token= = %d with session %+v; want 303 and a cookie without the token", name, r.StatusCode, session)
		}
		if r := get(t, hc, c.URL+"/ui", map[string]string{"Cookie": session.String()}); r.StatusCode != http.StatusOK {
			t.Errorf("%s token: GET /ui with its session = %d, want 200", name, r.StatusCode)
		}
		if err := c.Client.RevokeToken(ctx, tok.ID); err != nil {
			t.Fatal(err)
		}
		if r := get(t, hc, c.URL+"/ui", map[string]string{"Cookie": session.String()}); r.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s token revoked: GET /ui with its session = %d, want 401", name, r.StatusCode)
		}
		if r := get(t, hc, c.URL+"/ui?token="+url.QueryEscape(tok.Secret), nil); r.StatusCode != http.StatusUnauthorized || len(r.Cookies()) != 0 {
			t.Errorf("%s token revoked: GET /ui?token= = %d with cookies %v, want 401 and none", name, r.StatusCode, r.Cookies())
		}
		if r := get(t, hc, c.URL+"/ui", map[string]string{"Authorization": "Bearer " + tok.Secret}); r.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s token revoked: GET /ui as bearer = %d, want 401", name, r.StatusCode)
		}
	}
}

// createProjectHTTP makes a project through POST /v1/projects as the
// bootstrap token.
func createProjectHTTP(t *testing.T, c *testenv.Control, body string) {
	t.Helper()
	if r := send(t, c, http.MethodPost, "/v1/projects", "Bearer "+c.Token, strings.NewReader(body), nil); r.status != http.StatusCreated {
		t.Fatalf("POST /v1/projects %s: %d %s", body, r.status, r.body)
	}
}

// projectCell is the HTML of one resource's cell (vcpus, memory_mib,
// disk_mib, vms) in a project's row of the fleet page, "" without one.
func projectCell(page, project, resource string) string {
	_, row, ok := strings.Cut(page, `<tr id="project-`+project+`">`)
	if !ok {
		return ""
	}
	row, _, _ = strings.Cut(row, "</tr>")
	_, cell, ok := strings.Cut(row, `<td class="`+resource+`">`)
	if !ok {
		return ""
	}
	cell, _, _ = strings.Cut(cell, "</td>")
	return cell
}

// The Projects section shows each project's usage against its quota per
// resource, "unlimited" where it has none; a project token's page shows
// its own project alone.
func TestFleetPageShowsProjectsAgainstTheirQuotas(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	ctx := context.Background()
	createProjectHTTP(t, c, `{"name":"team-a","quotas":{"vcpus":4,"memory_mib":4096}}`)
	createProjectHTTP(t, c, `{"name":"team-b","description":"the other team","quotas":{"vms":2}}`)
	if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Project: "team-a", Image: "sim",
		VCPUs: 2, MemoryMiB: 1024, DiskMiB: 2048}, ""); err != nil {
		t.Fatal(err)
	}

	r := send(t, c, http.MethodGet, "/ui", "Bearer "+c.Token, nil, nil)
	if r.status != http.StatusOK {
		t.Fatalf("GET /ui = %d", r.status)
	}
	page := string(r.body)
	for _, ch := range []struct {
		project, resource string
		want              []string
	}{
		{"team-a", "vcpus", []string{`max="4"`, `value="2"`, `high="3"`, "2 / 4 (50%)"}},
		{"team-a", "memory_mib", []string{`max="4096"`, `value="1024"`, "1.0 / 4.0 GiB (25%)"}},
		{"team-a", "disk_mib", []string{"2.0 GiB", "unlimited"}},
		{"team-a", "vms", []string{"1", "unlimited"}},
		{"team-b", "vms", []string{`max="2"`, `value="0"`, "0 / 2 (0%)"}},
		{"team-b", "vcpus", []string{"0", "unlimited"}},
		{api.DefaultProject, "vms", []string{"0", "unlimited"}},
	} {
		cell := projectCell(page, ch.project, ch.resource)
		for _, w := range ch.want {
			if !strings.Contains(cell, w) {
				t.Errorf("fleet-wide token: %s's %s cell is %q, want it to contain %q", ch.project, ch.resource, cell, w)
			}
		}
	}
	for _, unlimited := range []string{projectCell(page, "team-a", "disk_mib"), projectCell(page, "team-b", "vcpus")} {
		if strings.Contains(unlimited, "<meter") {
			t.Errorf("an unlimited resource shows a bar: %q", unlimited)
		}
	}
	if !strings.Contains(page, "the other team") {
		t.Error("the page does not show team-b's description")
	}

	tok, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "b-ui", Scopes: []string{api.ScopeUser}, Project: "team-b"})
	if err != nil {
		t.Fatal(err)
	}
	r = send(t, c, http.MethodGet, "/ui", "Bearer "+tok.Secret, nil, nil)
	if r.status != http.StatusOK {
		t.Fatalf("GET /ui as team-b's token = %d", r.status)
	}
	page = string(r.body)
	if projectCell(page, "team-b", "vms") == "" {
		t.Error("team-b's token: its own project is not on the page")
	}
	for _, other := range []string{"team-a", api.DefaultProject} {
		if strings.Contains(page, `id="project-`+other+`"`) {
			t.Errorf("team-b's token sees project %s on the fleet page", other)
		}
	}
}
