package httpapi_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// Kinds of object a path parameter names, for the project walk.
const (
	paramVM      = "vm id"
	paramFork    = "fork id"
	paramNetwork = "network name"
	paramProject = "project name"
	paramToken   = "token id"
	paramVolume  = "volume id"
	// aName is a name a body gives (a VM name, a placement group, an
	// Idempotency-Key), not a path parameter.
	aName = "name"
)

// How TestProjectIsolationWalk walks a route as a token of project A.
const (
	// byObject: the path parameter names an object of a project. With an
	// object of another project the answer must be exactly the answer to
	// an unknown one of the same shape.
	byObject = "object of another project"
	// byBody: the body names objects; walked with the route's bodyProbes.
	byBody = "body naming objects of another project"
	// byList: a list; as A it holds only A's objects (the route's listCheck).
	byList = "list of the caller's project"
	// fleetWide: hosts and images belong to the fleet: a project token
	// reads exactly what a fleet-wide token reads and writes nothing.
	fleetWide = "fleet-wide"
	// adminOnly: a project token never holds the admin scope: 403.
	adminOnly = "admin only"
	// noObject: the route names no object of any project.
	noObject = "names no object"
)

type projectDecision struct {
	how   string
	param string // byObject: the kind of object the path parameter names
	why   string
	// fixed: byObject, the values of the route's other path parameters
	// (":volume" of a VM's volume), the same in both requests.
	fixed map[string]string
}

// projectDecisions is how every route the server serves is walked by a
// project token, written out on purpose. A route the server serves that is
// missing here fails TestProjectIsolationWalk, so every new route needs a
// project decision (and, like scopeMatrix, a scope decision).
var projectDecisions = map[string]projectDecision{
	"GET /v1/info":                 {how: fleetWide, why: "the control API's version is the fleet's: readable by every token"},
	"PUT /v1/hosts/:name":          {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"GET /v1/hosts":                {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"GET /v1/hosts/:name":          {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"DELETE /v1/hosts/:name":       {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"POST /v1/hosts/:name/retire":  {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"POST /v1/hosts/:name/drain":   {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"POST /v1/hosts/:name/undrain": {how: fleetWide, why: "hosts are the fleet's: readable by every token, written by admins"},
	"POST /v1/vms":                 {how: byBody},
	"GET /v1/vms":                  {how: byList},
	"GET /v1/vms/:id":              {how: byObject, param: paramVM},
	"GET /v1/vms/:id/console":      {how: byObject, param: paramVM},
	"GET /v1/vms/:id/guest":        {how: byObject, param: paramVM},
	"PATCH /v1/vms/:id":            {how: byObject, param: paramVM},
	"DELETE /v1/vms/:id":           {how: byObject, param: paramVM},
	"POST /v1/vms/:id/migrate":     {how: byObject, param: paramVM},
	"POST /v1/vms/:id/volumes":     {how: byObject, param: paramVM},
	// B's VM with a volume name that names none: the answer must be the one for an
	// unknown VM (B's volume in A's attach is TestVolumeHotAttachBadInput's).
	"DELETE /v1/vms/:id/volumes/:volume": {how: byObject, param: paramVM, fixed: map[string]string{":volume": "alpha-vol"}},
	"POST /v1/placements":                {how: byBody},
	"POST /v1/forks":                     {how: byBody},
	"GET /v1/forks/:id":                  {how: byObject, param: paramFork},
	"PATCH /v1/forks/:id":                {how: byObject, param: paramFork},
	"DELETE /v1/forks/:id":               {how: byObject, param: paramFork},
	"POST /v1/networks":                  {how: adminOnly, why: "networks are made by admins, for a project"},
	"GET /v1/networks":                   {how: byList},
	"GET /v1/networks/:name":             {how: byObject, param: paramNetwork},
	"PATCH /v1/networks/:name":           {how: byObject, param: paramNetwork},
	"DELETE /v1/networks/:name":          {how: byObject, param: paramNetwork},
	"POST /v1/images":                    {how: fleetWide, why: "images are the fleet's: readable by every token, written by admins"},
	"GET /v1/images":                     {how: fleetWide, why: "images are the fleet's: readable by every token, written by admins"},
	"GET /v1/images/:name":               {how: fleetWide, why: "images are the fleet's: readable by every token, written by admins"},
	"PATCH /v1/images/:name":             {how: fleetWide, why: "images are the fleet's: readable by every token, written by admins"},
	"DELETE /v1/images/:name":            {how: fleetWide, why: "images are the fleet's: readable by every token, written by admins"},
	"GET /v1/whoami":                     {how: noObject, why: "answers the caller's own token: its scopes and project"},
	"POST /v1/tokens":                    {how: adminOnly, why: "tokens are made by admins; a project token never makes one"},
	"GET /v1/tokens":                     {how: adminOnly, why: "tokens are listed by admins only"},
	"DELETE /v1/tokens/:id":              {how: byObject, param: paramToken},
	"POST /v1/projects":                  {how: adminOnly, why: "projects are made by admins"},
	"GET /v1/projects":                   {how: byList},
	"GET /v1/projects/:name":             {how: byObject, param: paramProject},
	"PATCH /v1/projects/:name":           {how: byObject, param: paramProject},
	"DELETE /v1/projects/:name":          {how: byObject, param: paramProject},
	"POST /v1/volumes":                   {how: byBody},
	"GET /v1/volumes":                    {how: byList},
	"GET /v1/volumes/:ref":               {how: byObject, param: paramVolume},
	"PATCH /v1/volumes/:ref":             {how: byObject, param: paramVolume},
	"POST /v1/volumes/:ref/resize":       {how: byObject, param: paramVolume},
	"POST /v1/volumes/:ref/move":         {how: byObject, param: paramVolume},
	"DELETE /v1/volumes/:ref":            {how: byObject, param: paramVolume},
	// A path no route serves answers no_route whatever it names.
	"echo_route_not_found /v1/*": {how: byObject, param: paramVM},
	"echo_route_not_found /v1":   {how: noObject, why: "the bare prefix names nothing"},
	// The fleet page shows VMs and forks: as A, only A's.
	"GET /ui":         {how: byList},
	"POST /ui/login":  {how: noObject, why: "takes the caller's own token and answers a session, no object"},
	"POST /ui/logout": {how: noObject, why: "ends the caller's own session"},
	"GET /healthz":    {how: noObject, why: "an open probe"},
	"GET /readyz":     {how: noObject, why: "an open probe"},
	"GET /metrics":    {how: noObject, why: "the operator's counters, labelled by route pattern, host, state and project name (usage per project), never by object id; --metrics-token keeps it to the operator"},
}

// walkAnswer is one answer to a project token.
type walkAnswer struct {
	status int
	ctype  string
	body   string
}

func (a walkAnswer) String() string { return fmt.Sprintf("%d %s", a.status, trim(a.body)) }

// errorCode is the code of an error envelope ("" for another body).
func (a walkAnswer) errorCode() string {
	var env api.ErrorBody
	if json.Unmarshal([]byte(a.body), &env) != nil {
		return ""
	}
	return env.Error.Code
}

// replaced is the answer with every occurrence of the value it was asked
// about replaced by a placeholder, so that two answers about two ids
// compare.
func (a walkAnswer) replaced(value string) walkAnswer {
	a.body = strings.ReplaceAll(a.body, value, "{ID}")
	return a
}

type projectWalk struct {
	t  *testing.T
	fc *fuzzControl
	// secrets are the ids and names of objects project A must never see.
	secrets []string
}

func (w *projectWalk) send(method, path, secret, body string, header map[string]string) walkAnswer {
	w.t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "Bearer "+secret)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	w.fc.handler.ServeHTTP(rec, req)
	return walkAnswer{status: rec.Code, ctype: rec.Header().Get("Content-Type"), body: strings.TrimSpace(rec.Body.String())}
}

// must sends a request that has to succeed with want and decodes its answer.
func (w *projectWalk) must(method, path, secret, body string, header map[string]string, want int, out any) {
	w.t.Helper()
	a := w.send(method, path, secret, body, header)
	if a.status != want {
		w.t.Fatalf("%s %s %s: %s; want %d", method, path, trim(body), a, want)
	}
	if out != nil {
		if err := json.Unmarshal([]byte(a.body), out); err != nil {
			w.t.Fatalf("%s %s: decode %s: %v", method, path, trim(a.body), err)
		}
	}
}

// leaks fails when an answer to A names an object of another project.
func (w *projectWalk) leaks(what string, a walkAnswer) {
	w.t.Helper()
	var named []string
	for _, s := range w.secrets {
		if strings.Contains(a.body, s) {
			named = append(named, s)
		}
	}
	if len(named) > 0 {
		w.t.Errorf("%s: the answer to project A names %q of other projects: %s", what, named, trim(a.body))
	}
}

// same fails unless the answer about another project's object is exactly
// the answer about an unknown one (after the value asked about is
// replaced in both).
func (w *projectWalk) same(what, other, unknown string, aOther, aUnknown walkAnswer, statusOnly bool) {
	w.t.Helper()
	ro, ru := aOther.replaced(other), aUnknown.replaced(unknown)
	w.leaks(what+" with "+other, ro)
	w.leaks(what+" with "+unknown, ru)
	differ := ro.status != ru.status || ro.errorCode() != ru.errorCode()
	if !statusOnly {
		differ = differ || ro.ctype != ru.ctype || ro.body != ru.body
	}
	if differ {
		w.t.Errorf("%s: another project's object answers unlike an unknown one:\n  with %s (another project's): %s\n  with %s (unknown):           %s",
			what, other, aOther, unknown, aUnknown)
	}
}

// unknownLike is a value of the same shape as another project's, that
// names nothing.
func unknownLike(kind string) string {
	switch kind {
	case paramNetwork:
		return "net-" + randomLabel(8)
	case paramProject:
		return "walk-" + randomLabel(6)
	case aName:
		return "name-" + randomLabel(8)
	}
	return uuid.Must(uuid.NewV7()).String()
}

func randomLabel(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyz"
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[rand.IntN(len(letters))]
	}
	return string(b)
}

// fillPath puts value into the one path parameter (or wildcard) of route.
func fillPath(t *testing.T, route, value string, fixed map[string]string) string {
	t.Helper()
	parts := strings.Split(route, "/")
	n := 0
	for i, s := range parts {
		if v, ok := fixed[s]; ok {
			parts[i] = url.PathEscape(v)
			continue
		}
		if strings.HasPrefix(s, ":") || s == "*" {
			parts[i] = url.PathEscape(value)
			n++
		}
	}
	if n != 1 {
		t.Errorf("route %s has %d path parameters; the project walk fills one: decide how to walk the others", route, n)
	}
	return strings.Join(parts, "/")
}

// bProject is what project B holds, as B sees it.
type bProject struct {
	VMs     api.List[api.VM]
	Fork    api.Fork
	Network api.Network
	Project api.Project
	Volumes api.List[api.Volume]
}

func (w *projectWalk) snapshotB(secretB, forkID string) bProject {
	w.t.Helper()
	var s bProject
	w.must(http.MethodGet, "/v1/vms?page_size=1000", secretB, "", nil, http.StatusOK, &s.VMs)
	w.must(http.MethodGet, "/v1/forks/"+forkID, secretB, "", nil, http.StatusOK, &s.Fork)
	w.must(http.MethodGet, "/v1/networks/bravo-net", secretB, "", nil, http.StatusOK, &s.Network)
	w.must(http.MethodGet, "/v1/projects/walk-b", secretB, "", nil, http.StatusOK, &s.Project)
	w.must(http.MethodGet, "/v1/volumes?page_size=1000", secretB, "", nil, http.StatusOK, &s.Volumes)
	for i := range s.VMs.Items {
		s.VMs.Items[i].ObservedState = "" // the agent's, not a request's
	}
	for i := range s.Fork.Children {
		s.Fork.Children[i].ObservedState = ""
	}
	return s
}

func vmBody(name, extra string) string {
	return `{"name":"` + name + `","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64` + extra + `}`
}

// TestProjectIsolationWalk walks every route the server serves with a token
// of project A and asks about the objects of project B (and of the
// default project): every answer must be exactly the answer about an
// unknown object of the same shape, so that ids cannot be probed; lists
// hold only A's objects; and B's objects are untouched afterwards.
func TestProjectIsolationWalk(t *testing.T) {
	fc := newFuzzControl(t)
	e, ok := fc.handler.(*echo.Echo)
	if !ok {
		t.Fatalf("httpapi.New returned %T; this test walks the routes of an *echo.Echo", fc.handler)
	}
	w := &projectWalk{t: t, fc: fc}
	admin := fc.token

	// Projects A and B, a user token of each, a network of each.
	for _, p := range []string{"walk-a", "walk-b"} {
		var out api.Project
		w.must(http.MethodPost, "/v1/projects", admin, `{"name":"`+p+`"}`, nil, http.StatusCreated, &out)
		if out.Name != p {
			t.Fatalf("POST /v1/projects %s answered project %q", p, out.Name)
		}
	}
	var tokA, tokB api.Token
	w.must(http.MethodPost, "/v1/tokens", admin, `{"name":"walk-a-user","scopes":["user"],"project":"walk-a"}`, nil, http.StatusCreated, &tokA)
	w.must(http.MethodPost, "/v1/tokens", admin, `{"name":"walk-b-user","scopes":["user"],"project":"walk-b"}`, nil, http.StatusCreated, &tokB)
	if tokA.Project != "walk-a" || tokB.Project != "walk-b" {
		t.Fatalf("project tokens answered projects %q and %q; want walk-a and walk-b", tokA.Project, tokB.Project)
	}
	a, b := tokA.Secret, tokB.Secret
	// A project token never holds the admin scope.
	for _, scopes := range []string{`["admin"]`, `["admin","user"]`} {
		ans := w.send(http.MethodPost, "/v1/tokens", admin, `{"name":"walk-a-admin","scopes":`+scopes+`,"project":"walk-a"}`, nil)
		if ans.status != http.StatusBadRequest && ans.status != http.StatusForbidden {
			t.Errorf("POST /v1/tokens with scopes %s for project walk-a: %s; want 400 or 403 (a project token is never admin)", scopes, ans)
		}
	}
	var netB, netA api.Network
	w.must(http.MethodPost, "/v1/networks", admin, `{"name":"bravo-net","project":"walk-b","mode":"nat","cidr":"10.91.0.0/24"}`, nil, http.StatusCreated, &netB)
	w.must(http.MethodPost, "/v1/networks", admin, `{"name":"alpha-net","project":"walk-a","mode":"nat","cidr":"10.92.0.0/24"}`, nil, http.StatusCreated, &netA)
	if netB.Project != "walk-b" {
		t.Fatalf("network bravo-net belongs to %q; want walk-b", netB.Project)
	}

	// B's objects, made by B: a VM on B's network in a placement group,
	// made with an Idempotency-Key, and a fork of it with one child in a
	// group of its own; a second VM in a third group. A probe that creates
	// puts A's VM in the group it names (A's group of that name), so each
	// probe of a group names a group of its own.
	const groupB, forkGroupB, placeGroupB = "bravo-grp", "bravo-fork-grp", "bravo-place-grp"
	const vmKeyB, forkKeyB = "bravo-vm-key", "bravo-fork-key"
	var srcB, twoB api.VM
	w.must(http.MethodPost, "/v1/vms", b, vmBody("bravo-src",
		`,"labels":{"team":"bravo"},"network_interfaces":[{"network":"bravo-net"},{"network":"default"}],`+
			`"constraints":{"group":"`+groupB+`","spread_by":"host","max_per_domain":1}`),
		map[string]string{"Idempotency-Key": vmKeyB}, http.StatusCreated, &srcB)
	w.must(http.MethodPost, "/v1/vms", b, vmBody("bravo-two", `,"constraints":{"group":"`+placeGroupB+`","max_per_domain":1}`),
		nil, http.StatusCreated, &twoB)
	var forkB api.Fork
	w.must(http.MethodPost, "/v1/forks", b, `{"source_vm_id":"`+srcB.ID+`","count":1,`+
		`"constraints":{"group":"`+forkGroupB+`","spread_by":"host","max_per_domain":1}}`,
		map[string]string{"Idempotency-Key": forkKeyB}, http.StatusCreated, &forkB)
	if srcB.Project != "walk-b" || forkB.Project != "walk-b" || len(forkB.Children) != 1 || forkB.Children[0].Project != "walk-b" {
		t.Fatalf("B's VM is in %q, its fork in %q with %d children; want all in walk-b", srcB.Project, forkB.Project, len(forkB.Children))
	}
	childB := forkB.Children[0]
	var volB api.Volume
	w.must(http.MethodPost, "/v1/volumes", b, `{"name":"bravo-vol","size_mib":64}`, nil, http.StatusCreated, &volB)
	// A's own objects, for lists and for reads that must work.
	var vmA api.VM
	w.must(http.MethodPost, "/v1/vms", a, vmBody("alpha-vm", `,"network_interfaces":[{"network":"alpha-net"}]`), nil, http.StatusCreated, &vmA)
	var forkA api.Fork
	w.must(http.MethodPost, "/v1/forks", a, `{"source_vm_id":"`+vmA.ID+`","count":1}`, nil, http.StatusCreated, &forkA)
	if vmA.Project != "walk-a" {
		t.Fatalf("A's VM is in project %q; want walk-a", vmA.Project)
	}
	for _, path := range []string{"/v1/vms/" + vmA.ID, "/v1/forks/" + forkA.ID, "/v1/networks/alpha-net",
		"/v1/networks/default", "/v1/projects/walk-a"} {
		if ans := w.send(http.MethodGet, path, a, "", nil); ans.status != http.StatusOK {
			t.Errorf("GET %s as project A: %s; want 200 (its own object, or the shared default network)", path, ans)
		}
	}

	// The objects A must not see: B's, and the default project's (the
	// fuzz control's VM and fork).
	others := map[string][]string{
		paramVM:      {srcB.ID, childB.ID, twoB.ID, fc.vmID},
		paramFork:    {forkB.ID, fc.forkID},
		paramNetwork: {"bravo-net"},
		paramProject: {"walk-b", api.DefaultProject},
		paramToken:   {tokB.ID},
		paramVolume:  {volB.ID},
	}
	w.secrets = []string{srcB.ID, childB.ID, childB.Name, "bravo-src", forkB.ID, "bravo-net", "walk-b", tokB.ID,
		twoB.ID, "bravo-two", volB.ID, "bravo-vol", volB.Serial, groupB, forkGroupB, placeGroupB, vmKeyB, forkKeyB, fc.vmID, fc.forkID, "fuzz-source"}
	before := w.snapshotB(b, forkB.ID)

	// Bodies of the routes walked by object (the rest send none).
	objectBodies := map[string]string{
		"PATCH /v1/vms/:id":            `{"labels":{"walk":"probe"}}`,
		"PATCH /v1/forks/:id":          `{"count":2}`,
		"PATCH /v1/networks/:name":     `{"hosts":[]}`,
		"PATCH /v1/projects/:name":     `{"description":"probe"}`,
		"PATCH /v1/volumes/:ref":       `{"size_mib":128}`,
		"POST /v1/volumes/:ref/resize": `{"size_mib":128}`,
		"POST /v1/volumes/:ref/move":   `{"host":"probe-host"}`,
		"POST /v1/vms/:id/volumes":     `{"volume":"alpha-vol"}`,
		"PUT /v1/hosts/:name":          `{"address":"http://127.0.0.1:1"}`,
		"PATCH /v1/images/:name":       `{}`,
		"POST /v1/images":              `{}`,
		"POST /v1/networks":            `{"name":"alpha-more","project":"walk-a","mode":"user"}`,
		"POST /v1/tokens":              `{"name":"alpha-more","scopes":["user"],"project":"walk-a"}`,
		"POST /v1/projects":            `{"name":"alpha-more"}`,
	}

	// The probes of the routes walked by body: each sends other (a value
	// of another project) and then a value of the same shape that names
	// nothing. creates: a 2xx answer makes an object, so each probe sends
	// a fresh name and only the statuses and codes compare.
	type bodyProbe struct {
		what    string
		other   string
		kind    string
		creates bool
		body    func(v string) string
		header  func(v string) map[string]string
	}
	fresh := func() string { return "alpha-" + randomLabel(8) }
	withGroup := func(g string) string {
		return `"constraints":{"group":"` + g + `","spread_by":"host","max_per_domain":1}`
	}
	var bodyProbes = map[string][]bodyProbe{
		"POST /v1/vms": {
			{what: "B's network in network_interfaces", other: "bravo-net", kind: paramNetwork,
				body: func(v string) string { return vmBody("alpha-probe", `,"network_interfaces":[{"network":"`+v+`"}]`) }},
			{what: "project B as the VM's project", other: "walk-b", kind: paramProject,
				body: func(v string) string { return vmBody("alpha-probe", `,"project":"`+v+`"`) }},
			{what: "the default project as the VM's project", other: api.DefaultProject, kind: paramProject,
				body: func(v string) string { return vmBody("alpha-probe", `,"project":"`+v+`"`) }},
			{what: "B's VM name", other: "bravo-src", kind: aName, creates: true,
				body: func(v string) string { return vmBody(v, "") }},
			{what: "B's Idempotency-Key", other: vmKeyB, kind: aName, creates: true,
				body:   func(string) string { return vmBody(fresh(), "") },
				header: func(v string) map[string]string { return map[string]string{"Idempotency-Key": v} }},
			{what: "B's placement group", other: groupB, kind: aName, creates: true,
				body: func(v string) string { return vmBody(fresh(), ","+withGroup(v)) }},
			{what: "B's volume in volumes", other: volB.ID, kind: paramVolume,
				body: func(v string) string { return vmBody("alpha-probe", `,"volumes":[{"volume":"`+v+`"}]`) }},
		},
		"POST /v1/forks": {
			{what: "B's VM as the source", other: srcB.ID, kind: paramVM,
				body: func(v string) string { return `{"source_vm_id":"` + v + `","count":1}` }},
			{what: "B's fork child as the source", other: childB.ID, kind: paramVM,
				body: func(v string) string { return `{"source_vm_id":"` + v + `","count":1}` }},
			{what: "the default project's VM as the source", other: fc.vmID, kind: paramVM,
				body: func(v string) string { return `{"source_vm_id":"` + v + `","count":1}` }},
			{what: "B's Idempotency-Key", other: forkKeyB, kind: aName, creates: true,
				body:   func(string) string { return `{"source_vm_id":"` + vmA.ID + `","count":1}` },
				header: func(v string) map[string]string { return map[string]string{"Idempotency-Key": v} }},
			{what: "B's fork's placement group", other: forkGroupB, kind: aName, creates: true,
				body: func(v string) string { return `{"source_vm_id":"` + vmA.ID + `","count":1,` + withGroup(v) + `}` }},
		},
		"POST /v1/volumes": {
			{what: "B's volume as the source", other: volB.ID, kind: paramVolume,
				body: func(v string) string { return `{"name":"alpha-clone","size_mib":64,"source":{"volume":"` + v + `"}}` }},
			{what: "project B as the volume's project", other: "walk-b", kind: paramProject,
				body: func(v string) string { return `{"name":"alpha-probe-vol","size_mib":64,"project":"` + v + `"}` }},
			{what: "B's volume name", other: "bravo-vol", kind: aName, creates: true,
				body: func(v string) string { return `{"name":"` + v + `","size_mib":64}` }},
		},
		"POST /v1/placements": {
			{what: "B's placement group", other: placeGroupB, kind: aName,
				body: func(v string) string {
					return `{"image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64,` + withGroup(v) + `}`
				}},
		},
	}

	// The lists and what A may find in them.
	idsOf := func(vms []api.VM) []string {
		var out []string
		for _, v := range vms {
			out = append(out, v.ID)
		}
		return out
	}
	listChecks := map[string]func(){
		"GET /v1/vms": func() {
			for _, q := range []string{"", "?host=h1", "?page_size=1000"} {
				ans := w.send(http.MethodGet, "/v1/vms"+q, a, "", nil)
				w.leaks("GET /v1/vms"+q+" as project A", ans)
				var l api.List[api.VM]
				if ans.status != http.StatusOK || json.Unmarshal([]byte(ans.body), &l) != nil {
					t.Errorf("GET /v1/vms%s as project A: %s; want 200 and a list", q, ans)
					continue
				}
				var foreign []string
				for _, v := range l.Items {
					if v.Project != "walk-a" {
						foreign = append(foreign, v.ID+" of project "+v.Project)
					}
				}
				if len(foreign) > 0 {
					t.Errorf("GET /v1/vms%s as project A lists VMs of other projects: %v", q, foreign)
				}
				if !slices.Contains(idsOf(l.Items), vmA.ID) {
					t.Errorf("GET /v1/vms%s as project A does not list A's own VM %s: %s", q, vmA.ID, trim(ans.body))
				}
			}
			// Filters naming B's objects answer as filters naming nothing.
			for _, f := range []struct{ param, other, kind string }{
				{"name", "bravo-src", aName}, {"name", childB.Name, aName}, {"name", "fuzz-source", aName},
				{"fork_id", forkB.ID, paramFork}, {"fork_id", fc.forkID, paramFork}, {"label", "team=bravo", aName},
			} {
				unknown := unknownLike(f.kind)
				if f.param == "label" {
					unknown = "team=" + randomLabel(5)
				}
				get := func(v string) walkAnswer {
					return w.send(http.MethodGet, "/v1/vms?"+f.param+"="+url.QueryEscape(v), a, "", nil)
				}
				w.same("GET /v1/vms?"+f.param+"= as project A", f.other, unknown, get(f.other), get(unknown), false)
			}
		},
		"GET /v1/networks": func() {
			ans := w.send(http.MethodGet, "/v1/networks", a, "", nil)
			w.leaks("GET /v1/networks as project A", ans)
			var l api.List[api.Network]
			if ans.status != http.StatusOK || json.Unmarshal([]byte(ans.body), &l) != nil {
				t.Errorf("GET /v1/networks as project A: %s; want 200 and a list", ans)
				return
			}
			var names []string
			for _, n := range l.Items {
				names = append(names, n.Name)
			}
			sort.Strings(names)
			if !slices.Equal(names, []string{"alpha-net", "default"}) {
				t.Errorf("GET /v1/networks as project A lists %v; want A's network and the shared default: [alpha-net default]", names)
			}
		},
		"GET /v1/volumes": func() {
			ans := w.send(http.MethodGet, "/v1/volumes?page_size=1000", a, "", nil)
			w.leaks("GET /v1/volumes as project A", ans)
			var l api.List[api.Volume]
			if ans.status != http.StatusOK || json.Unmarshal([]byte(ans.body), &l) != nil {
				t.Errorf("GET /v1/volumes as project A: %s; want 200 and a list", ans)
				return
			}
			for _, v := range l.Items {
				if v.Project != "walk-a" {
					t.Errorf("GET /v1/volumes as project A lists volume %s of project %s", v.ID, v.Project)
				}
			}
		},
		"GET /v1/projects": func() {
			ans := w.send(http.MethodGet, "/v1/projects", a, "", nil)
			w.leaks("GET /v1/projects as project A", ans)
			var l api.List[api.Project]
			if ans.status != http.StatusOK || json.Unmarshal([]byte(ans.body), &l) != nil {
				t.Errorf("GET /v1/projects as project A: %s; want 200 and a list", ans)
				return
			}
			if len(l.Items) != 1 || l.Items[0].Name != "walk-a" {
				t.Errorf("GET /v1/projects as project A: %s; want only walk-a", trim(ans.body))
			}
		},
		"GET /ui": func() {
			// As a bearer token, and through a session of the token.
			bearer := w.send(http.MethodGet, "/ui", a, "", nil)
			h := w.fc.handler
			req := httptest.NewRequest(http.MethodGet, "/ui?token="+url.QueryEscape(a), nil)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			var cookie string
			for _, ck := range rec.Result().Cookies() {
				if ck.Name == "kvmd_ui" {
					cookie = ck.String()
				}
			}
			answers := map[string]walkAnswer{"as a bearer token": bearer}
			if cookie != "" {
				req := httptest.NewRequest(http.MethodGet, "/ui", nil)
				req.Header.Set("Cookie", cookie)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				answers["through a session"] = walkAnswer{status: rec.Code, body: rec.Body.String()}
			}
			for how, ans := range answers {
				w.leaks("GET /ui "+how+" of project A", ans)
				if ans.status == http.StatusOK && !strings.Contains(ans.body, vmA.ID) {
					t.Errorf("GET /ui %s of project A shows the fleet page without A's own VM %s", how, vmA.ID)
				}
			}
		},
	}

	// The walk: every route the server serves. Lists first, before the
	// body probes give A objects named like B's (a VM named bravo-src in
	// A is A's); deletes last, so that the other routes still find B's
	// objects if a delete wrongly went through.
	routes := e.Routes()
	rank := func(r *echo.Route) int {
		switch {
		case r.Method == http.MethodDelete:
			return 3
		case projectDecisions[r.Method+" "+r.Path].how == byList:
			return 0
		case projectDecisions[r.Method+" "+r.Path].how == byBody:
			return 2
		}
		return 1
	}
	sort.SliceStable(routes, func(i, j int) bool {
		if ri, rj := rank(routes[i]), rank(routes[j]); ri != rj {
			return ri < rj
		}
		return routes[i].Method+routes[i].Path < routes[j].Method+routes[j].Path
	})
	seen := map[string]bool{}
	for _, r := range routes {
		key := r.Method + " " + r.Path
		if strings.HasPrefix(r.Method, "echo_") {
			key = "echo_route_not_found " + r.Path
		}
		d, decided := projectDecisions[key]
		if !decided {
			t.Errorf("route %s has no project decision in projectDecisions: decide whether it names an object of a project (and walk it) or why it is fleet-wide", key)
			continue
		}
		seen[key] = true
		method := routeMethod(r)
		switch d.how {
		case byObject:
			for _, other := range others[d.param] {
				unknown := unknownLike(d.param)
				body := objectBodies[key]
				w.same(fmt.Sprintf("%s as project A (%s)", key, d.param), other, unknown,
					w.send(method, fillPath(t, r.Path, other, d.fixed), a, body, nil),
					w.send(method, fillPath(t, r.Path, unknown, d.fixed), a, body, nil), false)
			}
		case byBody:
			probes, ok := bodyProbes[key]
			if !ok {
				t.Errorf("route %s is walked by body but has no bodyProbes", key)
			}
			for _, p := range probes {
				unknown := unknownLike(p.kind)
				send := func(v string) walkAnswer {
					var h map[string]string
					if p.header != nil {
						h = p.header(v)
					}
					return w.send(method, r.Path, a, p.body(v), h)
				}
				w.same(fmt.Sprintf("%s as project A with %s", key, p.what), p.other, unknown, send(p.other), send(unknown), p.creates)
			}
		case byList:
			check, ok := listChecks[key]
			if !ok {
				t.Errorf("route %s is walked as a list but has no listChecks", key)
				continue
			}
			check()
		case fleetWide:
			path := strings.NewReplacer(":name", fleetObject(r.Path)).Replace(r.Path)
			asA := w.send(method, path, a, objectBodies[key], nil)
			w.leaks(key+" as project A", asA)
			if method == http.MethodGet {
				asAdmin := w.send(method, path, admin, "", nil)
				if asA.status != asAdmin.status || asA.body != asAdmin.body {
					t.Errorf("%s (fleet-wide): project A reads %s; a fleet-wide token reads %s", path, asA, asAdmin)
				}
			} else if asA.status != http.StatusForbidden {
				t.Errorf("%s %s (fleet-wide, admins write) as project A: %s; want 403", method, path, asA)
			}
		case adminOnly:
			if ans := w.send(method, r.Path, a, objectBodies[key], nil); ans.status != http.StatusForbidden || ans.errorCode() != api.CodeForbidden {
				t.Errorf("%s (%s) as project A: %s; want 403 forbidden", key, d.why, ans)
			}
		case noObject:
			if d.why == "" {
				t.Errorf("route %s names no object but gives no reason", key)
			}
		default:
			t.Errorf("route %s: unknown walk %q", key, d.how)
		}
	}
	for key := range projectDecisions {
		if !seen[key] {
			t.Errorf("projectDecisions names %s, which the server does not serve", key)
		}
	}

	// B's objects are untouched, and B's token still works.
	after := w.snapshotB(b, forkB.ID)
	bj, _ := json.Marshal(before)
	aj, _ := json.Marshal(after)
	if string(bj) != string(aj) {
		t.Errorf("project A's walk changed project B:\nbefore %s\nafter  %s", bj, aj)
	}
}

// fleetObject is a real object of a fleet-wide route: host h1, image sim.
func fleetObject(route string) string {
	if strings.HasPrefix(route, "/v1/images") {
		return "sim"
	}
	return "h1"
}

// TestProjectTokensEndWithTheirProject: deleting a project deletes its
// tokens, so a token of a deleted project answers 401 like any unknown
// token, on every kind of route.
func TestProjectTokensEndWithTheirProject(t *testing.T) {
	fc := newFuzzControl(t)
	w := &projectWalk{t: t, fc: fc}
	w.must(http.MethodPost, "/v1/projects", fc.token, `{"name":"walk-gone"}`, nil, http.StatusCreated, nil)
	var tok api.Token
	w.must(http.MethodPost, "/v1/tokens", fc.token, `{"name":"walk-gone-user","scopes":["user"],"project":"walk-gone"}`, nil, http.StatusCreated, &tok)
	w.must(http.MethodGet, "/v1/vms", tok.Secret, "", nil, http.StatusOK, nil)
	w.must(http.MethodGet, "/v1/projects/walk-gone", tok.Secret, "", nil, http.StatusOK, nil)
	w.must(http.MethodDelete, "/v1/projects/walk-gone", fc.token, "", nil, http.StatusNoContent, nil)
	const unauthorized = `{"error":{"code":"unauthorized","message":"unauthorized"}}`
	for _, r := range []struct{ method, path, body string }{
		{http.MethodGet, "/v1/vms", ""},
		{http.MethodGet, "/v1/projects/walk-gone", ""},
		{http.MethodGet, "/v1/hosts", ""},
		{http.MethodPost, "/v1/vms", vmBody("gone-vm", "")},
	} {
		if ans := w.send(r.method, r.path, tok.Secret, r.body, nil); ans.status != http.StatusUnauthorized || ans.body != unauthorized {
			t.Errorf("%s %s with a token of the deleted project walk-gone: %s; want 401 %s", r.method, r.path, ans, unauthorized)
		}
	}
	var tokens api.List[api.Token]
	w.must(http.MethodGet, "/v1/tokens?page_size=1000", fc.token, "", nil, http.StatusOK, &tokens)
	for _, x := range tokens.Items {
		if x.ID == tok.ID || x.Project == "walk-gone" {
			t.Errorf("GET /v1/tokens after deleting project walk-gone still lists its token %s (%s)", x.ID, x.Name)
		}
	}
}

// TestProjectNamesAreDNSLabels: a project name is a DNS label (lowercase
// letters, digits and '-', at most 63, not starting or ending with '-');
// anything else is 400 invalid naming the field, and nothing is created.
func TestProjectNamesAreDNSLabels(t *testing.T) {
	fc := newFuzzControl(t)
	w := &projectWalk{t: t, fc: fc}
	bad := []string{"", "Upper", "under_score", "dot.ted", "-lead", "trail-", "sp ace", "ünïcode", strings.Repeat("a", 64)}
	for _, name := range bad {
		body, _ := json.Marshal(api.ProjectCreate{Name: name})
		ans := w.send(http.MethodPost, "/v1/projects", fc.token, string(body), nil)
		if ans.status != http.StatusBadRequest || ans.errorCode() != api.CodeInvalid || !strings.Contains(ans.body, "name") {
			t.Errorf("POST /v1/projects with name %q: %s; want 400 invalid naming the field", name, ans)
		}
	}
	var l api.List[api.Project]
	w.must(http.MethodGet, "/v1/projects?page_size=1000", fc.token, "", nil, http.StatusOK, &l)
	for _, p := range l.Items {
		if slices.Contains(bad, p.Name) {
			t.Errorf("a refused project name %q was created", p.Name)
		}
	}
	// The longest label and one with digits and inner dashes are names.
	for _, name := range []string{strings.Repeat("a", 63), "0-team-9"} {
		w.must(http.MethodPost, "/v1/projects", fc.token, `{"name":"`+name+`"}`, nil, http.StatusCreated, nil)
	}
}
