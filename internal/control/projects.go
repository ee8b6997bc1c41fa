package control

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Projects: a team's share of the fleet.
//
// Every VM, fork and network belongs to one project; a token belongs to
// one (a project token) or is fleet-wide. A project token sees and acts on
// its own project's objects only, and an object of another project answers
// exactly as an unknown id (visibleVM and its siblings build the very same
// error), so ids cannot be probed. Hosts and images are fleet-wide.
//
// Networks belong to a project and are made by fleet-wide admins: a
// network reaches things (an operator's bridge, LAN ranges through allow),
// so which exist is an operator's decision, and which team may attach to
// one is the project's. The default user-mode network is shared by every
// project: each NIC on it is a network of its own (passt), so sharing it
// joins no two guests.
//
// Quotas live in the reservation itself (store/projects.go): one atomic
// statement on PostgreSQL, one transaction on SQLite.

type principalCtxKey struct{}

// WithPrincipal returns ctx carrying who sends the request: its project
// scopes what the request may see, its caller keys Idempotency-Keys.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return WithCaller(context.WithValue(ctx, principalCtxKey{}, p), p.Caller())
}

// principalOf is the principal of ctx; a call made in process without one
// acts fleet-wide, as the bootstrap token.
func principalOf(ctx context.Context) Principal {
	if p, ok := ctx.Value(principalCtxKey{}).(Principal); ok {
		return p
	}
	return BootstrapPrincipal()
}

// Sees says whether the principal may see and act on an object of project.
func (p Principal) Sees(project string) bool { return p.Project == "" || p.Project == project }

// WhoAmI says who ctx's principal is (GET /v1/whoami): a client learns
// its token's project, and where its creates go, without listing anything.
func WhoAmI(ctx context.Context) api.WhoAmI {
	p := principalOf(ctx)
	out := api.WhoAmI{TokenID: p.TokenID, Name: p.Name, Scopes: p.Scopes, Project: p.Project, CreateProject: p.Project}
	if out.CreateProject == "" {
		out.CreateProject = api.DefaultProject
	}
	return out
}

// visibleVM reads VM id if the caller's project may see it; otherwise the
// answer is the store's own for an unknown id.
func (s *Service) visibleVM(ctx context.Context, id string) (store.VM, error) {
	vm, err := s.store.GetVM(ctx, id)
	if err == nil && !principalOf(ctx).Sees(vm.Project) {
		return store.VM{}, fmt.Errorf("vm %s: %w", id, store.ErrNotFound)
	}
	return vm, err
}

// visibleFork is visibleVM for forks.
func (s *Service) visibleFork(ctx context.Context, id string) (store.Fork, error) {
	f, err := s.store.GetFork(ctx, id)
	if err == nil && !principalOf(ctx).Sees(f.Project) {
		return store.Fork{}, fmt.Errorf("fork %v: %w", id, store.ErrNotFound)
	}
	return f, err
}

// attachable says whether a VM of project may have a NIC on network n:
// its project's networks and the shared default user-mode network.
func attachable(n store.Network, project string) bool {
	return n.Project == project || n.Name == api.DefaultNetwork
}

// visibleNetwork is visibleVM for networks: the caller's project's and
// the shared default network.
func (s *Service) visibleNetwork(ctx context.Context, name string) (store.Network, error) {
	n, err := s.store.GetNetwork(ctx, name)
	if err == nil {
		if p := principalOf(ctx); p.Project != "" && !attachable(n, p.Project) {
			return store.Network{}, fmt.Errorf("network %q: %w", name, store.ErrNotFound)
		}
	}
	return n, err
}

// projectFor resolves the project a new object of the caller goes to:
// asked names it (empty: the caller's own, or default for a fleet-wide
// token). A project token naming another project, and an unknown project,
// get the same not_found.
func (s *Service) projectFor(ctx context.Context, asked string) (store.Project, error) {
	name, err := projectAsked(ctx, asked)
	if err != nil {
		return store.Project{}, err
	}
	proj, err := s.store.GetProject(ctx, name)
	if errors.Is(err, store.ErrNotFound) {
		s.projects.forget(name)
		return store.Project{}, projectNotFound(name)
	}
	if err != nil {
		return store.Project{}, fromStore(err, "read project "+name)
	}
	s.projects.put(proj)
	return proj, nil
}

// projectAsked is the name of the project a new object of the caller goes
// to (asked, the caller's own, or default), or the not_found of a project
// the caller does not see.
func projectAsked(ctx context.Context, asked string) (string, error) {
	p := principalOf(ctx)
	name := asked
	if name == "" {
		name = p.Project
	}
	if name == "" {
		name = api.DefaultProject
	}
	if !p.Sees(name) {
		return "", projectNotFound(name)
	}
	return name, nil
}

// placementProject is projectFor for a VM's placement: the project from
// this replica's cache when it has it. The reservation names the
// generation read (store.VM.ProjectGeneration) and places nothing if the
// project changed or went since (placeInProject reads it again then), so
// a stale copy costs a retry, never a VM placed by old host labels.
func (s *Service) placementProject(ctx context.Context, asked string) (store.Project, error) {
	name, err := projectAsked(ctx, asked)
	if err != nil {
		return store.Project{}, err
	}
	if proj, ok := s.projects.get(name); ok {
		return proj, nil
	}
	return s.projectFor(ctx, name)
}

// projectRereads bounds how often one placement reads its project again
// after finding it changed.
const projectRereads = 3

// placeInProject places and reserves vm in project (placeAndReserve) under
// the project's host labels merged into the asked constraints. When the
// reservation finds the project changed since it was read, it reads the
// project again, checks the constraints against its new labels and places
// again.
func (s *Service) placeInProject(ctx context.Context, vm *store.VM, nics vmNICs, req scheduler.Request,
	asked *api.Constraints, project store.Project,
) error {
	for attempt := 0; ; attempt++ {
		vm.ProjectGeneration = project.Generation
		req.Constraints = schedConstraints(projectConstraints(asked, project))
		err := s.placeAndReserve(ctx, vm, nics, req)
		if !errors.Is(err, store.ErrProjectChanged) {
			return err
		}
		s.projects.forget(project.Name)
		if attempt == projectRereads {
			return unavailable(err, "project %q kept changing while VM %q was placed; retry", project.Name, vm.Name)
		}
		s.log.Debug("project changed during placement; reading it again", "project", project.Name, "vm", vm.ID)
		if project, err = s.projectFor(ctx, project.Name); err != nil {
			return err
		}
		if err := checkProjectLabels(asked, project); err != nil {
			return err
		}
	}
}

// projectCache keeps the projects this replica placed VMs in, by name. It
// is only ever a guess: reservations check the generation they were placed
// by, and a replica that changes or deletes a project forgets it at once.
type projectCache struct {
	mu     sync.Mutex
	byName map[string]store.Project
}

func (c *projectCache) get(name string) (store.Project, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok := c.byName[name]
	return p, ok
}

func (c *projectCache) put(p store.Project) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byName == nil {
		c.byName = map[string]store.Project{}
	}
	c.byName[p.Name] = p
}

func (c *projectCache) forget(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.byName, name)
}

func isQuota(err error) bool {
	var qe *store.QuotaError
	return errors.As(err, &qe)
}

func projectNotFound(name string) error {
	return notFoundf("project %q does not exist; an admin creates it (POST /v1/projects), and a project token acts in its own project only", name)
}

// quotaExceeded is the 409 of a reservation that would cross a quota.
func quotaExceeded(qe *store.QuotaError) error {
	return &Error{Code: api.CodeQuotaExceeded, Err: qe,
		Message: fmt.Sprintf("project %s is at its %s quota: %d of %d in use, %d more requested; free some, or ask an admin to raise the quota",
			qe.Project, qe.Resource, qe.Used, qe.Limit, qe.Requested),
		Details: map[string]any{"project": qe.Project, "resource": qe.Resource, "limit": qe.Limit, "used": qe.Used, "requested": qe.Requested}}
}

// dnsLabel is a project name: lowercase letters, digits and '-', starting
// and ending with a letter or digit, at most 63 (RFC 1123 label).
var dnsLabel = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

func validateProjectName(name string) error {
	if !dnsLabel.MatchString(name) {
		return invalidf("project name %q is not a DNS label: use 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit", name)
	}
	return nil
}

func validateQuotas(q api.Quotas) error {
	for _, f := range []struct {
		name string
		v    *int64
	}{{api.ResourceVCPUs, q.VCPUs}, {api.ResourceMemoryMiB, q.MemoryMiB}, {api.ResourceDiskMiB, q.DiskMiB}, {api.ResourceVMs, q.VMs}} {
		if f.v != nil && *f.v < 0 {
			return invalidf("quotas.%s is %d: a quota is 0 or more (leave it unset for unlimited)", f.name, *f.v)
		}
	}
	return nil
}

func validateHostLabels(labels map[string]string) error {
	for k := range labels {
		if k == "" {
			return invalidf("host_labels: a label key is empty")
		}
	}
	return nil
}

// CreateProject makes a project (admin).
func (s *Service) CreateProject(ctx context.Context, in api.ProjectCreate) (api.Project, error) {
	if err := validateProjectName(in.Name); err != nil {
		return api.Project{}, err
	}
	if err := validateQuotas(in.Quotas); err != nil {
		return api.Project{}, err
	}
	if err := validateHostLabels(in.HostLabels); err != nil {
		return api.Project{}, err
	}
	row, err := s.store.InsertProject(ctx, store.Project{Name: in.Name, Description: in.Description,
		HostLabels: in.HostLabels, Quotas: storeQuotas(in.Quotas)})
	if errors.Is(err, store.ErrDuplicateName) {
		return api.Project{}, conflictf("project %q already exists", in.Name)
	}
	if err != nil {
		return api.Project{}, fromStore(err, "create project "+in.Name)
	}
	s.log.Info("project created", "project", row.Name)
	s.refreshProjectMetrics(ctx)
	return apiProject(row), nil
}

// GetProject returns one project: any for a fleet-wide token, its own for
// a project token.
func (s *Service) GetProject(ctx context.Context, name string) (api.Project, error) {
	if !principalOf(ctx).Sees(name) {
		return api.Project{}, projectNotFound(name)
	}
	row, err := s.store.GetProject(ctx, name)
	if errors.Is(err, store.ErrNotFound) {
		return api.Project{}, projectNotFound(name)
	}
	if err != nil {
		return api.Project{}, fromStore(err, "read project "+name)
	}
	return apiProject(row), nil
}

// ListProjects returns one page of the projects the caller sees, by name.
func (s *Service) ListProjects(ctx context.Context, pg Page) (api.List[api.Project], error) {
	size, after, err := pg.bounds()
	if err != nil {
		return api.List[api.Project]{}, err
	}
	out := api.List[api.Project]{Items: []api.Project{}}
	if p := principalOf(ctx); p.Project != "" {
		if p.Project > after {
			if row, err := s.store.GetProject(ctx, p.Project); err == nil {
				out.Items = append(out.Items, apiProject(row))
			}
		}
		return out, nil
	}
	rows, err := s.store.ListProjects(ctx, after, size+1)
	if err != nil {
		return api.List[api.Project]{}, fromStore(err, "list projects")
	}
	rows, out.NextPageToken = cutPage(rows, size, func(r store.Project) string { return r.Name })
	for _, r := range rows {
		out.Items = append(out.Items, apiProject(r))
	}
	return out, nil
}

// AllProjects returns every project (metrics and the fleet page).
func (s *Service) AllProjects(ctx context.Context) ([]api.Project, error) {
	var out []api.Project
	after := ""
	for {
		rows, err := s.store.ListProjects(ctx, after, api.MaxPageSize)
		if err != nil {
			return nil, fromStore(err, "list projects")
		}
		for _, r := range rows {
			out = append(out, apiProject(r))
		}
		if len(rows) < api.MaxPageSize {
			return out, nil
		}
		after = rows[len(rows)-1].Name
	}
}

// refreshProjectMetrics reads every project for kvm_project_usage and
// kvm_project_quota (metrics.go); on an error the last read stays.
func (s *Service) refreshProjectMetrics(ctx context.Context) {
	readAt := time.Now()
	projects, err := s.AllProjects(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("read the projects for kvm_project_usage and kvm_project_quota; the metrics keep the last read", "err", err)
		}
		return
	}
	s.metrics.projects.set(readAt, projects)
}

// UpdateProject changes a project's description, quotas or host labels
// (admin). A quota below the usage is accepted: it refuses growth from
// then on and stops nothing; new host labels steer future placements only.
func (s *Service) UpdateProject(ctx context.Context, name string, in api.ProjectPatch) (api.Project, error) {
	u := store.ProjectUpdate{Description: in.Description, HostLabels: in.HostLabels}
	if in.Quotas != nil {
		if err := validateQuotas(*in.Quotas); err != nil {
			return api.Project{}, err
		}
		q := storeQuotas(*in.Quotas)
		u.Quotas = &q
	}
	if in.HostLabels != nil {
		if err := validateHostLabels(*in.HostLabels); err != nil {
			return api.Project{}, err
		}
	}
	row, err := s.store.UpdateProject(ctx, name, u)
	s.projects.forget(name)
	if errors.Is(err, store.ErrNotFound) {
		return api.Project{}, projectNotFound(name)
	}
	if err != nil {
		return api.Project{}, fromStore(err, "update project "+name)
	}
	s.log.Info("project updated", "project", name)
	s.refreshProjectMetrics(ctx)
	return apiProject(row), nil
}

// DeleteProject deletes an empty project and its tokens (admin): 409
// while it holds VMs, forks or networks. The default project stays.
func (s *Service) DeleteProject(ctx context.Context, name string) error {
	if name == api.DefaultProject {
		return conflictf("project %q holds everything made without a project and cannot be deleted", name)
	}
	err := s.store.DeleteProject(ctx, name)
	s.projects.forget(name)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return projectNotFound(name)
	case errors.Is(err, store.ErrProjectInUse):
		return conflictf("%s; delete them first", err.Error())
	case err != nil:
		return fromStore(err, "delete project "+name)
	}
	// Its tokens are gone from the database; this replica forgets them at
	// once, the others within TokenCacheTTL.
	s.tokens.forgetProject(name)
	s.log.Info("project deleted", "project", name)
	s.refreshProjectMetrics(ctx)
	return nil
}

// projectConstraints are the constraints a VM of project is placed with:
// the project's host labels join the VM's own (the project's win on a
// clash, so no VM can step outside them), and its group is the project's
// own (projectGroup).
func projectConstraints(c *api.Constraints, p store.Project) *api.Constraints {
	if c != nil && c.Group != "" {
		grouped := *c
		grouped.Group = projectGroup(p.Name, c.Group)
		c = &grouped
	}
	if len(p.HostLabels) == 0 {
		return c
	}
	out := api.Constraints{}
	if c != nil {
		out = *c
	}
	labels := maps.Clone(out.HostLabels)
	if labels == nil {
		labels = map[string]string{}
	}
	maps.Copy(labels, p.HostLabels)
	out.HostLabels = labels
	return &out
}

// projectGroup is the name a placement group of project has in the
// database: groups of two projects with one name are two groups, so one
// team neither fills nor sees another's domains. A user's group name
// cannot hold '/'; the default project's keep their plain names (the rows
// from before projects).
func projectGroup(project, group string) string {
	if project == api.DefaultProject {
		return group
	}
	return project + "/" + group
}

// checkProjectLabels refuses constraints that ask for a host label the
// project pins to another value: such a VM could never be placed, and
// saying so beats a silent no_capacity.
func checkProjectLabels(c *api.Constraints, p store.Project) error {
	if c == nil {
		return nil
	}
	for k, v := range c.HostLabels {
		if want, ok := p.HostLabels[k]; ok && want != v {
			return &Error{Code: api.CodeInvalid, Details: map[string]any{"field": "constraints.host_labels." + k, "project": p.Name},
				Message: fmt.Sprintf("constraints.host_labels asks %s=%s, but project %s confines its VMs to hosts with %s=%s; drop the label or ask for %s",
					k, v, p.Name, k, want, want)}
		}
	}
	return nil
}

func storeQuotas(q api.Quotas) store.Quotas {
	return store.Quotas{VCPUs: q.VCPUs, MemoryMiB: q.MemoryMiB, DiskMiB: q.DiskMiB, VMs: q.VMs}
}

func apiProject(r store.Project) api.Project {
	labels := r.HostLabels
	if labels == nil {
		labels = map[string]string{}
	}
	return api.Project{Name: r.Name, Description: r.Description, HostLabels: labels, CreatedAt: r.CreatedAt,
		Quotas: api.Quotas{VCPUs: r.Quotas.VCPUs, MemoryMiB: r.Quotas.MemoryMiB, DiskMiB: r.Quotas.DiskMiB, VMs: r.Quotas.VMs},
		Usage:  api.ProjectUsage{VCPUs: r.Used.VCPUs, MemoryMiB: r.Used.MemoryMiB, DiskMiB: r.Used.DiskMiB, VMs: r.Used.VMs}}
}
