package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// DefaultProject holds what is made without a project.
const DefaultProject = "default"

// isQuota says whether err is a reservation refused by a project quota.
func isQuota(err error) bool {
	var qe *QuotaError
	return errors.As(err, &qe)
}

// Errors of projects.
var (
	// ErrProjectChanged: a reservation named a project generation that is
	// no longer the project's (it changed or was deleted since the caller
	// read it); nothing was reserved, and the caller reads it again.
	ErrProjectChanged = errors.New("project changed or was deleted since it was read")
	// ErrProjectInUse: the project still holds VMs, forks or networks.
	ErrProjectInUse = errors.New("project still holds VMs, forks or networks")
)

// Quota resources, as the CHECK constraints of projects name them
// (projects_<resource>_quota).
const (
	QuotaVCPUs     = "vcpus"
	QuotaMemoryMiB = "memory_mib"
	QuotaDiskMiB   = "disk_mib"
	QuotaVMs       = "vms"
)

// QuotaError is a reservation refused because it would take its project
// past a quota. Used and Limit are as read just after the refusal.
type QuotaError struct {
	Project   string
	Resource  string
	Limit     int64
	Used      int64
	Requested int64
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("project %s: %s quota %d, %d in use, %d more requested", e.Project, e.Resource, e.Limit, e.Used, e.Requested)
}

// Quotas are a project's limits; nil is unlimited.
type Quotas struct {
	VCPUs     *int64 `gorm:"column:quota_vcpus"`
	MemoryMiB *int64 `gorm:"column:quota_memory_mib"`
	DiskMiB   *int64 `gorm:"column:quota_disk_mib"`
	VMs       *int64 `gorm:"column:quota_vms"`
}

// Usage is what a project's VMs that hold capacity hold.
type Usage struct {
	VCPUs     int64 `gorm:"column:used_vcpus"`
	MemoryMiB int64 `gorm:"column:used_memory_mib"`
	DiskMiB   int64 `gorm:"column:used_disk_mib"`
	VMs       int64 `gorm:"column:used_vms"`
}

// Project is a row of projects.
type Project struct {
	Name        string            `gorm:"column:name;primaryKey"`
	Description string            `gorm:"column:description"`
	HostLabels  map[string]string `gorm:"column:host_labels;serializer:json"`
	Quotas      Quotas            `gorm:"embedded"`
	Used        Usage             `gorm:"embedded"`
	// Generation grows by one on every change of the row's settings.
	Generation int64     `gorm:"column:generation"`
	CreatedAt  time.Time `gorm:"column:created_at"`
	UpdatedAt  time.Time `gorm:"column:updated_at"`
}

// TableName is the table of Project.
func (Project) TableName() string { return "projects" }

// limit is the quota of resource (nil: unlimited) and what is used of it.
func (p Project) limit(resource string) (*int64, int64) {
	switch resource {
	case QuotaVCPUs:
		return p.Quotas.VCPUs, p.Used.VCPUs
	case QuotaMemoryMiB:
		return p.Quotas.MemoryMiB, p.Used.MemoryMiB
	case QuotaDiskMiB:
		return p.Quotas.DiskMiB, p.Used.DiskMiB
	default:
		return p.Quotas.VMs, p.Used.VMs
	}
}

// InsertProject stores a new project with no usage. ErrDuplicateName when
// the name is taken.
func (s *Store) InsertProject(ctx context.Context, p Project) (Project, error) {
	t := now()
	p.CreatedAt, p.UpdatedAt, p.Used, p.Generation = t, t, Usage{}, 1
	if p.HostLabels == nil {
		p.HostLabels = map[string]string{}
	}
	err := s.db.WithContext(ctx).Create(&p).Error
	if isDuplicate(err) {
		return Project{}, fmt.Errorf("project %q: %w", p.Name, ErrDuplicateName)
	}
	if err != nil {
		return Project{}, fmt.Errorf("insert project %q: %w", p.Name, err)
	}
	return p, nil
}

// GetProject returns one project; ErrNotFound when there is none.
func (s *Store) GetProject(ctx context.Context, name string) (Project, error) {
	return readProject(s.db.WithContext(ctx), name)
}

// readProject reads one project through db, its usage without what its
// quota leases hold.
func readProject(db *gorm.DB, name string) (Project, error) {
	var p Project
	err := db.Where("name = ?", name).Take(&p).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Project{}, fmt.Errorf("project %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return Project{}, fmt.Errorf("read project %q: %w", name, err)
	}
	ps := []Project{p}
	if err := withoutLeases(db, ps); err != nil {
		return Project{}, err
	}
	return ps[0], nil
}

// ListProjects returns up to limit projects with names after `after`, by name.
func (s *Store) ListProjects(ctx context.Context, after string, limit int) ([]Project, error) {
	var out []Project
	if err := keysetPage(s.db.WithContext(ctx), "name", after, limit).Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list projects: %w", err)
	}
	if err := withoutLeases(s.db.WithContext(ctx), out); err != nil {
		return nil, err
	}
	return out, nil
}

// ProjectUpdate is what UpdateProject changes; nil fields stay.
type ProjectUpdate struct {
	Description *string
	Quotas      *Quotas
	HostLabels  *map[string]string
}

// UpdateProject changes a project in place. New quotas take effect for
// the next reservation; a quota below the usage is kept (growth is
// refused, nothing running stops): the usage of now is recorded as the
// ceiling it may only shrink from (above_quota_*).
func (s *Store) UpdateProject(ctx context.Context, name string, u ProjectUpdate) (Project, error) {
	var p Project
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		cols := map[string]any{"updated_at": now(), "generation": gorm.Expr("generation + 1")}
		if u.Description != nil {
			cols["description"] = *u.Description
		}
		if u.HostLabels != nil {
			labels, err := jsonText(*u.HostLabels)
			if err != nil {
				return err
			}
			cols["host_labels"] = labels
		}
		if u.Quotas != nil && s.dialect == DialectPostgres {
			// The usage of now is the VMs' alone: the leases go back first.
			if err := reclaimLeases(tx, name, nil); err != nil {
				return err
			}
		}
		if u.Quotas != nil {
			cols["quota_vcpus"], cols["quota_memory_mib"] = u.Quotas.VCPUs, u.Quotas.MemoryMiB
			cols["quota_disk_mib"], cols["quota_vms"] = u.Quotas.DiskMiB, u.Quotas.VMs
			cols["above_quota_vcpus"] = gorm.Expr("used_vcpus")
			cols["above_quota_memory_mib"] = gorm.Expr("used_memory_mib")
			cols["above_quota_disk_mib"] = gorm.Expr("used_disk_mib")
			cols["above_quota_vms"] = gorm.Expr("used_vms")
		}
		res := tx.Model(&Project{}).Where("name = ?", name).Updates(cols)
		if res.Error != nil {
			return fmt.Errorf("update project %q: %w", name, res.Error)
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("project %q: %w", name, ErrNotFound)
		}
		var err error
		p, err = readProject(tx, name)
		return err
	})
	return p, err
}

// DeleteProject removes an empty project and its tokens in one
// transaction (a token of a deleted project stops working at once).
// ErrProjectInUse while it holds VMs, forks or networks; ErrNotFound when
// there is none.
func (s *Store) DeleteProject(ctx context.Context, name string) error {
	return s.inTx(ctx, func(tx *gorm.DB) error {
		// Its quota leases first (the order of every writer: leases, then
		// the project's row), then the row lock: a reservation into the
		// project holds it too (FOR KEY SHARE), so none can slip in
		// between the count and the delete.
		if err := tx.Exec("DELETE FROM quota_leases WHERE project = ?", name).Error; err != nil {
			return fmt.Errorf("delete quota leases of project %q: %w", name, err)
		}
		var p Project
		q := tx.Where("name = ?", name)
		if s.dialect == DialectPostgres {
			q = q.Clauses(clause.Locking{Strength: "UPDATE"})
		}
		if err := q.Take(&p).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return fmt.Errorf("project %q: %w", name, ErrNotFound)
			}
			return fmt.Errorf("read project %q: %w", name, err)
		}
		var held int64
		if err := tx.Raw(`SELECT (SELECT COUNT(*) FROM vms WHERE project = ?) + (SELECT COUNT(*) FROM forks WHERE project = ?)
			+ (SELECT COUNT(*) FROM networks WHERE project = ?) + (SELECT COUNT(*) FROM volumes WHERE project = ?)`,
			name, name, name, name).Scan(&held).Error; err != nil {
			return fmt.Errorf("count objects of project %q: %w", name, err)
		}
		if held > 0 {
			return fmt.Errorf("project %q holds %d VMs, forks, networks or volumes: %w", name, held, ErrProjectInUse)
		}
		if err := tx.Exec("DELETE FROM tokens WHERE project = ?", name).Error; err != nil {
			return fmt.Errorf("delete tokens of project %q: %w", name, err)
		}
		return tx.Exec("DELETE FROM projects WHERE name = ?", name).Error
	})
}

// chargeProjectSQL adds a VM's share to its project (arguments: vcpus,
// memory, disk, vm count, project, then the generation the caller read
// twice: 0 for any). Past a quota the row's CHECK fails the statement
// (quotaResource tells which).
const chargeProjectSQL = `UPDATE projects SET used_vcpus = used_vcpus + ?, used_memory_mib = used_memory_mib + ?,
	used_disk_mib = used_disk_mib + ?, used_vms = used_vms + ? WHERE name = ? AND (? = 0 OR generation = ?)`

// creditProjectSQL gives a share back (arguments: vcpus, memory, disk, vm
// count, then the same four again, then the project). A ceiling above the
// quota comes down with the usage, so usage above a lowered quota only
// ever shrinks.
const creditProjectSQL = `UPDATE projects SET used_vcpus = used_vcpus - ?, used_memory_mib = used_memory_mib - ?,
	used_disk_mib = used_disk_mib - ?, used_vms = used_vms - ?,
	above_quota_vcpus = CASE WHEN above_quota_vcpus > used_vcpus - ? THEN used_vcpus - ? ELSE above_quota_vcpus END,
	above_quota_memory_mib = CASE WHEN above_quota_memory_mib > used_memory_mib - ? THEN used_memory_mib - ? ELSE above_quota_memory_mib END,
	above_quota_disk_mib = CASE WHEN above_quota_disk_mib > used_disk_mib - ? THEN used_disk_mib - ? ELSE above_quota_disk_mib END,
	above_quota_vms = CASE WHEN above_quota_vms > used_vms - ? THEN used_vms - ? ELSE above_quota_vms END
	WHERE name = ?`

// share is what a reservation of r (and n VMs) adds to its project.
type share struct {
	Resources
	VMs int64
}

// chargeProject adds a share to project inside tx; a *QuotaError when it
// would cross a quota (the statement changed nothing then).
func (s *Store) chargeProject(tx *gorm.DB, project string, sh share) error {
	if s.dialect != DialectPostgres || sh == (share{}) {
		return chargeProject(tx, project, 0, sh, tx)
	}
	// On PostgreSQL a refusal aborts the transaction: the charge runs
	// under a savepoint, and the refusal's figures are read in the
	// transaction after going back to it (not on a second connection,
	// which many refusals at once could wait for forever).
	if err := tx.SavePoint("charge").Error; err != nil {
		return fmt.Errorf("count usage of project %q: %w", project, err)
	}
	res := tx.Exec(chargeProjectSQL, sh.VCPUs, sh.MemoryMiB, sh.DiskMiB, sh.VMs, project, 0, 0)
	if resource := quotaResource(res.Error); resource != "" {
		if err := tx.RollbackTo("charge").Error; err != nil {
			return fmt.Errorf("count usage of project %q: %w", project, err)
		}
		return quotaError(tx, project, resource, sh)
	}
	switch {
	case res.Error != nil:
		return fmt.Errorf("count usage of project %q: %w", project, res.Error)
	case res.RowsAffected == 0:
		return fmt.Errorf("project %q: %w", project, ErrNotFound)
	}
	return nil
}

// chargeProject is Store.chargeProject with the project's generation the
// caller read (0: any; another one is ErrProjectChanged) and the
// connection that reads a refusal's figures.
func chargeProject(tx *gorm.DB, project string, generation int64, sh share, read *gorm.DB) error {
	return chargeProjectWith(func(args ...any) (int64, error) {
		res := tx.Exec(chargeProjectSQL, args...)
		return res.RowsAffected, res.Error
	}, project, generation, sh, read)
}

// chargeProjectWith is chargeProject with exec running chargeProjectSQL
// (a prepared statement of a reservation batch, say) and telling how many
// rows it changed.
func chargeProjectWith(exec func(args ...any) (int64, error), project string, generation int64, sh share, read *gorm.DB) error {
	if sh == (share{}) {
		return nil
	}
	rows, err := exec(sh.VCPUs, sh.MemoryMiB, sh.DiskMiB, sh.VMs, project, generation, generation)
	if err == nil {
		switch {
		case rows != 0:
			return nil
		case generation != 0:
			return fmt.Errorf("project %q (generation %d): %w", project, generation, ErrProjectChanged)
		}
		return fmt.Errorf("project %q: %w", project, ErrNotFound)
	}
	if resource := quotaResource(err); resource != "" {
		return quotaError(read, project, resource, sh)
	}
	return fmt.Errorf("count usage of project %q: %w", project, err)
}

// creditProject gives a share back to project inside tx.
func creditProject(tx *gorm.DB, project string, sh share) error {
	if sh == (share{}) {
		return nil
	}
	err := tx.Exec(creditProjectSQL, sh.VCPUs, sh.MemoryMiB, sh.DiskMiB, sh.VMs,
		sh.VCPUs, sh.VCPUs, sh.MemoryMiB, sh.MemoryMiB, sh.DiskMiB, sh.DiskMiB, sh.VMs, sh.VMs, project).Error
	if err != nil {
		return fmt.Errorf("release usage of project %q: %w", project, err)
	}
	return nil
}

// quotaResource is the resource whose quota CHECK refused a statement
// ("" when err is no quota refusal). PostgreSQL names the constraint in
// the error's fields, SQLite in its message.
func quotaResource(err error) string {
	if err == nil {
		return ""
	}
	name := pgConstraint(err)
	if name == "" {
		msg := err.Error()
		i := strings.Index(msg, "projects_")
		if i < 0 || !strings.Contains(msg, "CHECK") {
			return ""
		}
		name = msg[i:]
		if j := strings.IndexAny(name, " \t\n,)"); j >= 0 {
			name = name[:j]
		}
	}
	resource, ok := strings.CutPrefix(name, "projects_")
	if !ok {
		return ""
	}
	resource, ok = strings.CutSuffix(resource, "_quota")
	if !ok {
		return ""
	}
	return resource
}

// quotaError reads the project's quota and usage through db for the
// error of a refused reservation of sh (on PostgreSQL outside the failed
// statement's transaction; on SQLite in the shared one, where a failed
// statement undoes only itself).
func quotaError(db *gorm.DB, project, resource string, sh share) error {
	qe := &QuotaError{Project: project, Resource: resource}
	switch resource {
	case QuotaVCPUs:
		qe.Requested = sh.VCPUs
	case QuotaMemoryMiB:
		qe.Requested = sh.MemoryMiB
	case QuotaDiskMiB:
		qe.Requested = sh.DiskMiB
	default:
		qe.Requested = sh.VMs
	}
	if p, err := readProject(db, project); err == nil {
		limit, used := p.limit(resource)
		if limit != nil {
			qe.Limit = *limit
		}
		qe.Used = used
	}
	return qe
}

// vmShare is what VM vm holds of its project while it holds capacity.
func vmShare(vm VM) share { return share{Resources: vm.held(), VMs: 1} }
