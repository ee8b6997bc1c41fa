package control_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// projectCall sends one request to the control API as token and decodes
// a 2xx answer into out; any other answer is returned as its envelope.
func projectCall(t *testing.T, c *testenv.Control, token, method, path string, in, out any) (int, api.ErrorDetail) {
	t.Helper()
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctxT(t), method, c.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode >= 300 {
		var e api.ErrorBody
		_ = json.Unmarshal(raw, &e)
		return resp.StatusCode, e.Error
	}
	if out != nil && len(raw) > 0 {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: decode %s: %v", method, path, raw, err)
		}
	}
	return resp.StatusCode, api.ErrorDetail{}
}

func createProject(t *testing.T, c *testenv.Control, in api.ProjectCreate) api.Project {
	t.Helper()
	var out api.Project
	if status, e := projectCall(t, c, c.Token, http.MethodPost, "/v1/projects", in, &out); status != http.StatusCreated {
		t.Fatalf("create project %s: %d %+v", in.Name, status, e)
	}
	return out
}

// projectClient is a client with a new user token of project.
func projectClient(t *testing.T, c *testenv.Control, project string) *client.Client {
	t.Helper()
	tok, err := c.Client.CreateToken(ctxT(t), api.TokenCreate{Name: project + "-ci", Scopes: []string{api.ScopeUser}, Project: project})
	if err != nil {
		t.Fatalf("token of project %s: %v", project, err)
	}
	return client.New(c.URL, tok.Secret)
}

func getProject(t *testing.T, c *testenv.Control, name string) api.Project {
	t.Helper()
	var p api.Project
	if status, e := projectCall(t, c, c.Token, http.MethodGet, "/v1/projects/"+name, nil, &p); status != http.StatusOK {
		t.Fatalf("get project %s: %d %+v", name, status, e)
	}
	return p
}

func quotaOf(n int64) *int64 { return &n }

// 200 creates of 1 vCPU over HTTP, split between two replicas on one
// PostgreSQL (and on SQLite), into a project with vcpus = 37 on a fleet
// with room for 200: exactly 37 succeed and 163 answer 409 quota_exceeded
// with the project, resource, limit, usage and request; the usage equals
// the rows, and deleting the VMs frees it.
func TestProjectQuotaUnderConcurrentCreates(t *testing.T) {
	eachDatabase(t, func(t *testing.T, url string) {
		replicas := []*testenv.Control{testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})}
		if url != "" {
			replicas = append(replicas, testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url}))
		}
		for i := range 4 {
			a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 50, MemoryMiB: 50 * 64, DiskMiB: 50 * 64})
			replicas[0].RegisterHost(t, fmt.Sprintf("host-%d", i), a.Address)
		}
		createProject(t, replicas[0], api.ProjectCreate{Name: "team-a", Quotas: api.Quotas{VCPUs: quotaOf(37)}})
		ctx := ctxT(t)
		var (
			wg              sync.WaitGroup
			mu              sync.Mutex
			placed, refused int
		)
		for i := range 200 {
			c := replicas[i%len(replicas)]
			wg.Go(func() {
				_, err := c.Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm-%03d", i), Project: "team-a", Image: "sim",
					VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, "")
				var e *client.Error
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					placed++
				case errors.As(err, &e) && e.Status == http.StatusConflict && e.Code == api.CodeQuotaExceeded:
					refused++
					d := e.Details
					if d["project"] != "team-a" || d["resource"] != "vcpus" || d["limit"] != float64(37) || d["requested"] != float64(1) {
						t.Errorf("quota_exceeded details %v: want project team-a, resource vcpus, limit 37, requested 1", d)
					}
					if _, ok := d["used"].(float64); !ok {
						t.Errorf("quota_exceeded details %v: want used", d)
					}
				default:
					t.Errorf("create vm-%03d: %v", i, err)
				}
			})
		}
		wg.Wait()
		if placed != 37 || refused != 163 {
			t.Fatalf("%d placed, %d quota_exceeded; want 37 and 163", placed, refused)
		}
		p := getProject(t, replicas[0], "team-a")
		vms, err := replicas[0].Client.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var vcpus int64
		for _, vm := range vms {
			if vm.Project == "team-a" {
				vcpus += vm.VCPUs
			}
		}
		if p.Usage.VCPUs != 37 || p.Usage.VMs != 37 || vcpus != 37 {
			t.Fatalf("usage %+v, VMs listed hold %d vCPUs; want 37 and 37 VMs", p.Usage, vcpus)
		}
		checkLedger(t, replicas[0].Store)
		for _, vm := range vms {
			if err := replicas[0].Client.DeleteVM(ctx, vm.ID); err != nil {
				t.Fatal(err)
			}
		}
		if p := getProject(t, replicas[0], "team-a"); p.Usage != (api.ProjectUsage{}) {
			t.Fatalf("usage after deleting every VM: %+v", p.Usage)
		}
	})
}

// A resize that would cross the quota is refused with quota_exceeded and
// the VM keeps running in its shape.
func TestProjectQuotaRefusesResize(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
	c.RegisterHost(t, "host-a", a.Address)
	createProject(t, c, api.ProjectCreate{Name: "team-a", Quotas: api.Quotas{VCPUs: quotaOf(3)}})
	team := projectClient(t, c, "team-a")
	ctx := ctxT(t)
	vm, err := team.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 2, MemoryMiB: 256, DiskMiB: 1024}, "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Project != "team-a" {
		t.Fatalf("a project token's VM is in %q, want its project", vm.Project)
	}
	four := int64(4)
	_, err = team.UpdateVM(ctx, vm.ID, api.VMPatch{VCPUs: &four})
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeQuotaExceeded || e.Details["requested"] != float64(2) || e.Details["used"] != float64(2) {
		t.Fatalf("resize 2 -> 4 vCPUs under vcpus = 3: got %v, want quota_exceeded for 2 more with 2 used", err)
	}
	got, err := team.GetVM(ctx, vm.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.VCPUs != 2 || got.ObservedState != api.StateRunning || got.PendingResize != nil {
		t.Fatalf("after a refused resize the VM is %d vCPUs, %s, pending %v; want 2, running, none", got.VCPUs, got.ObservedState, got.PendingResize)
	}
	three := int64(3)
	if _, err := team.UpdateVM(ctx, vm.ID, api.VMPatch{VCPUs: &three}); err != nil {
		t.Fatalf("resize to exactly the quota: %v", err)
	}
	if p := getProject(t, c, "team-a"); p.Usage.VCPUs != 3 {
		t.Fatalf("usage after the resize: %+v", p.Usage)
	}
}

// Fork children are VMs of the source's project and count against it.
func TestProjectQuotaCountsForkChildren(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
	c.RegisterHost(t, "host-a", a.Address)
	createProject(t, c, api.ProjectCreate{Name: "team-a", Quotas: api.Quotas{VMs: quotaOf(3)}})
	team := projectClient(t, c, "team-a")
	ctx := ctxT(t)
	src, err := team.CreateVM(ctx, api.VMCreate{Name: "src", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if err != nil {
		t.Fatal(err)
	}
	f, err := team.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2}, "")
	if err != nil {
		t.Fatalf("fork of 2 children at 1 of 3 VMs: %v", err)
	}
	if f.Project != "team-a" || len(f.Children) != 2 || f.Children[0].Project != "team-a" {
		t.Fatalf("fork %+v: want project team-a and two children of it", f)
	}
	three := 3
	_, err = team.UpdateFork(ctx, f.ID, api.ForkPatch{Count: &three})
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeQuotaExceeded || e.Details["resource"] != "vms" {
		t.Fatalf("a third child at 3 of 3 VMs: got %v, want quota_exceeded on vms", err)
	}
	if p := getProject(t, c, "team-a"); p.Usage.VMs != 3 {
		t.Fatalf("usage %+v, want 3 VMs", p.Usage)
	}
}

// A project's host labels confine its VMs (and its dry runs) to the hosts
// that carry them, whatever the VM itself asks.
func TestProjectHostLabelsConfineItsVMs(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	for _, h := range []struct{ name, pool string }{{"host-a", "shared"}, {"host-b", "team-a"}} {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
		if _, err := c.Client.PutHost(ctxT(t), h.name, api.HostPut{Address: a.Address, Labels: map[string]string{"pool": h.pool}}); err != nil {
			t.Fatal(err)
		}
	}
	createProject(t, c, api.ProjectCreate{Name: "team-a", HostLabels: map[string]string{"pool": "team-a"}})
	team := projectClient(t, c, "team-a")
	ctx := ctxT(t)
	for i := range 4 {
		vm, err := team.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm-%d", i), Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
		if err != nil {
			t.Fatal(err)
		}
		if vm.Host != "host-b" {
			t.Fatalf("VM %s of team-a placed on %s, outside the project's hosts", vm.Name, vm.Host)
		}
	}
	_, err := team.CreateVM(ctx, api.VMCreate{Name: "escape", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024, Host: "host-a"}, "")
	if apiCode(err) != api.CodeNoCapacity {
		t.Fatalf("a VM pinned outside its project's hosts: got %v, want no_capacity", err)
	}
	_, err = team.CreateVM(ctx, api.VMCreate{Name: "escape", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024,
		Constraints: &api.Constraints{HostLabels: map[string]string{"pool": "shared"}}}, "")
	if apiCode(err) != api.CodeInvalid {
		t.Fatalf("a VM asking for another pool: got %v, want invalid", err)
	}
}

// What a user of the API gets wrong: a bad name, a negative quota, an
// unknown project, a project token naming another project, a project
// token asking for admin, a project still in use, a token of a deleted
// project.
func TestProjectBadInput(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
	c.RegisterHost(t, "host-a", a.Address)
	for _, name := range []string{"Team", "team_a", "-team", "team-", "", "a.b", "x234567890123456789012345678901234567890123456789012345678901234"} {
		status, e := projectCall(t, c, c.Token, http.MethodPost, "/v1/projects", api.ProjectCreate{Name: name}, nil)
		if status != http.StatusBadRequest || e.Code != api.CodeInvalid {
			t.Errorf("project name %q: %d %s, want 400 invalid", name, status, e.Code)
		}
	}
	status, e := projectCall(t, c, c.Token, http.MethodPost, "/v1/projects", api.ProjectCreate{Name: "neg", Quotas: api.Quotas{VCPUs: quotaOf(-1)}}, nil)
	if status != http.StatusBadRequest {
		t.Errorf("a negative quota: %d %+v, want 400", status, e)
	}
	createProject(t, c, api.ProjectCreate{Name: "team-a"})
	createProject(t, c, api.ProjectCreate{Name: "team-b"})
	if status, _ := projectCall(t, c, c.Token, http.MethodPost, "/v1/projects", api.ProjectCreate{Name: "team-a"}, nil); status != http.StatusConflict {
		t.Errorf("a second team-a: %d, want 409", status)
	}
	ctx := ctxT(t)
	_, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "x", Project: "nope", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if apiCode(err) != api.CodeNotFound {
		t.Errorf("a VM in an unknown project: %v, want not_found", err)
	}
	teamA := projectClient(t, c, "team-a")
	_, errOther := teamA.CreateVM(ctx, api.VMCreate{Name: "x", Project: "team-b", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	_, errUnknown := teamA.CreateVM(ctx, api.VMCreate{Name: "x", Project: "team-q", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if apiCode(errOther) != api.CodeNotFound || apiCode(errUnknown) != api.CodeNotFound {
		t.Errorf("a team-a token naming team-b: %v; naming an unknown project: %v; want both not_found", errOther, errUnknown)
	}
	if _, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "x", Scopes: []string{api.ScopeAdmin}, Project: "team-a"}); apiCode(err) != api.CodeInvalid {
		t.Errorf("an admin token of a project: %v, want invalid", err)
	}
	if _, err := c.Client.CreateToken(ctx, api.TokenCreate{Name: "x", Scopes: []string{api.ScopeUser}, Project: "nope"}); apiCode(err) != api.CodeNotFound {
		t.Errorf("a token of an unknown project: %v, want not_found", err)
	}
	// Two projects may use the same VM name.
	if _, err := teamA.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, ""); err != nil {
		t.Fatal(err)
	}
	teamB := projectClient(t, c, "team-b")
	vmB, err := teamB.CreateVM(ctx, api.VMCreate{Name: "web", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if err != nil {
		t.Fatalf("team-b's VM named like team-a's: %v", err)
	}
	if status, e := projectCall(t, c, c.Token, http.MethodDelete, "/v1/projects/team-b", nil, nil); status != http.StatusConflict {
		t.Errorf("delete of a project with a VM: %d %+v, want 409", status, e)
	}
	if err := teamB.DeleteVM(ctx, vmB.ID); err != nil {
		t.Fatal(err)
	}
	if status, e := projectCall(t, c, c.Token, http.MethodDelete, "/v1/projects/team-b", nil, nil); status != http.StatusNoContent {
		t.Fatalf("delete of an empty project: %d %+v", status, e)
	}
	var ce *client.Error
	if _, err := teamB.AllVMs(ctx, client.ListOptions{}); !errors.As(err, &ce) || ce.Status != http.StatusUnauthorized {
		t.Fatalf("a token of a deleted project: %v, want 401", err)
	}
	// A quota below the usage is accepted (it refuses growth only).
	var p api.Project
	if status, e := projectCall(t, c, c.Token, http.MethodPatch, "/v1/projects/team-a", api.ProjectPatch{Quotas: &api.Quotas{VMs: quotaOf(0)}}, &p); status != http.StatusOK {
		t.Fatalf("quota below usage: %d %+v, want 200", status, e)
	}
	if p.Usage.VMs != 1 || p.Quotas.VMs == nil || *p.Quotas.VMs != 0 {
		t.Fatalf("project after the quota change: %+v", p)
	}
	_, err = teamA.CreateVM(ctx, api.VMCreate{Name: "more", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if apiCode(err) != api.CodeQuotaExceeded {
		t.Fatalf("a create above the lowered quota: %v, want quota_exceeded", err)
	}
	if status, _ := projectCall(t, c, c.Token, http.MethodDelete, "/v1/projects/default", nil, nil); status != http.StatusConflict {
		t.Errorf("delete of default: %d, want 409", status)
	}
}

// Placement groups are per project: a group of one project neither fills
// nor reveals the domains of another project's group with the same name.
func TestProjectPlacementGroupsArePerProject(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
	c.RegisterHost(t, "host-a", a.Address)
	createProject(t, c, api.ProjectCreate{Name: "team-b"})
	createProject(t, c, api.ProjectCreate{Name: "team-c"})
	ctx := ctxT(t)
	grouped := func(name string) api.VMCreate {
		return api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024,
			Constraints: &api.Constraints{Group: "grp", SpreadBy: "host", MaxPerDomain: 1}}
	}
	teamB, teamC := projectClient(t, c, "team-b"), projectClient(t, c, "team-c")
	if _, err := teamB.CreateVM(ctx, grouped("b-1"), ""); err != nil {
		t.Fatal(err)
	}
	if _, err := teamB.CreateVM(ctx, grouped("b-2"), ""); apiCode(err) != api.CodeNoCapacity {
		t.Fatalf("team-b's second VM of its capped group on the one host: %v, want no_capacity", err)
	}
	res, err := teamC.Place(ctx, api.PlacementRequest{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024,
		Constraints: &api.Constraints{Group: "grp", SpreadBy: "host", MaxPerDomain: 1}})
	if err != nil || len(res.Ranked) != 1 {
		t.Fatalf("team-c's dry run for its own group grp: %+v, %v; want host-a ranked (team-b's group is not team-c's)", res, err)
	}
	if _, err := teamC.CreateVM(ctx, grouped("c-1"), ""); err != nil {
		t.Fatalf("team-c's first VM of its group grp: %v", err)
	}
	// The default project's groups keep their plain names.
	if _, err := c.Client.CreateVM(ctx, grouped("d-1"), ""); err != nil {
		t.Fatalf("default's first VM of its group grp: %v", err)
	}
}

// GET /v1/whoami tells a client its token's project and where its creates
// go without naming it.
func TestWhoAmISaysTheTokensProject(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	createProject(t, c, api.ProjectCreate{Name: "team-a"})
	ctx := ctxT(t)
	who, err := projectClient(t, c, "team-a").WhoAmI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if who.Project != "team-a" || who.CreateProject != "team-a" || len(who.Scopes) != 1 || who.TokenID == "" {
		t.Fatalf("a team-a token: %+v", who)
	}
	who, err = c.Client.WhoAmI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if who.Project != "" || who.CreateProject != api.DefaultProject || who.TokenID != "" {
		t.Fatalf("the bootstrap token: %+v, want fleet-wide with creates into default", who)
	}
}

// A replica keeps the projects it places VMs in. When another replica
// changes a project's host labels, the next create through the first
// replica goes by the new labels (its reservation finds the project at a
// newer generation, reads it again and places again), and a project
// deleted on another replica is not_found there at once.
func TestProjectChangedOnAnotherReplicaPlacesByItsNewLabels(t *testing.T) {
	for _, dialect := range []string{"sqlite", "postgres"} {
		t.Run(dialect, func(t *testing.T) {
			opts := testenv.ControlOptions{DataDir: t.TempDir()}
			if dialect == "postgres" {
				opts = testenv.ControlOptions{DatabaseURL: testenv.PostgresURL(t)}
			}
			first, second := testenv.StartControl(t, opts), testenv.StartControl(t, opts)
			for _, h := range []struct{ name, pool string }{{"host-a", "shared"}, {"host-b", "team-a"}} {
				a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 16, MemoryMiB: 16384, DiskMiB: 100000})
				if _, err := first.Client.PutHost(ctxT(t), h.name, api.HostPut{Address: a.Address, Labels: map[string]string{"pool": h.pool}}); err != nil {
					t.Fatal(err)
				}
			}
			createProject(t, first, api.ProjectCreate{Name: "team-a", HostLabels: map[string]string{"pool": "team-a"}})
			ctx := ctxT(t)
			create := func(name string) api.VM {
				t.Helper()
				vm, err := first.Client.CreateVM(ctx, api.VMCreate{Name: name, Project: "team-a", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
				if err != nil {
					t.Fatal(err)
				}
				return vm
			}
			if vm := create("before"); vm.Host != "host-b" {
				t.Fatalf("VM of team-a placed on %s before the change, want host-b", vm.Host)
			}
			shared := map[string]string{"pool": "shared"}
			if _, err := second.Client.UpdateProject(ctx, "team-a", api.ProjectPatch{HostLabels: &shared}); err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				if vm := create(fmt.Sprintf("after-%d", i)); vm.Host != "host-a" {
					t.Fatalf("VM of team-a placed on %s after its labels moved to pool=shared on another replica, want host-a", vm.Host)
				}
			}
			createProject(t, first, api.ProjectCreate{Name: "team-b"})
			if _, err := first.Client.CreateVM(ctx, api.VMCreate{Name: "b", Project: "team-b", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, ""); err != nil {
				t.Fatal(err)
			}
			vms, err := first.Client.AllVMs(ctx, client.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, vm := range vms {
				if vm.Project == "team-b" {
					if err := first.Client.DeleteVM(ctx, vm.ID); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := second.Client.DeleteProject(ctx, "team-b"); err != nil {
				t.Fatal(err)
			}
			_, err = first.Client.CreateVM(ctx, api.VMCreate{Name: "b2", Project: "team-b", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
			if apiCode(err) != api.CodeNotFound {
				t.Fatalf("a VM in a project deleted on another replica: %v, want not_found", err)
			}
			checkLedger(t, first.Store)
		})
	}
}
