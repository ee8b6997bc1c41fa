package store

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
)

// Quota leases (PostgreSQL only; table quota_leases).
//
// Every reservation of a project adds to one row, the project's usage. A
// row updated in a transaction stays locked until its commit has reached
// the disk, so with that row in every batch a project's batches committed
// one after another, and placement at 10,000 hosts lost about half its
// throughput. With leases, each reservation committer holds a share of
// each project's quotas in a row of its own: a grant moves the share
// from the project's row (whose used_* count it, under the quota CHECKs)
// to the committer's lease, and a batch spends from its committer's lease
// only. No two committers write the same lease, so their batches commit
// side by side again.
//
// Exactness does not depend on the leases: a project's used_* is always
// the usage of its VMs plus what its leases hold, and never passes a
// quota. A reservation that the project's row refuses takes every lease
// of the project back to it and tries again in the same transaction
// (reserveReclaiming); only what is refused then is over the quota. A
// batched reservation reserves its host only if its lease covers it (the
// lease's row is locked first); one that a reclaim left short runs alone,
// on the project's row, and its holder reads its leases again.
//
// Every writer locks rows in one order: quota leases, host, the project's
// row, group slot.
//
// A project's reported usage is used_* minus its leases (readProject).

// leaseGrowth is how many batches' worth of a project's resources a grant
// asks for; a grant never takes more than a quarter of what is left under
// a quota (leaseShare), so that near one every committer's batches
// fall back to the project's row, where reclaims decide.
const leaseGrowth = 32

// leaseBook is what one committer believes its leases hold, by project.
// Only that committer's goroutine uses it. It may believe too much (a
// reclaim took a lease away): the batch's statements then find the lease
// short and the book is read again.
type leaseBook struct {
	holder string
	left   map[string]share
}

func newLeaseBooks(n int) []*leaseBook {
	id := uuid.Must(uuid.NewV7()).String()
	books := make([]*leaseBook, n)
	for i := range books {
		books[i] = &leaseBook{holder: fmt.Sprintf("%s/%d", id, i), left: map[string]share{}}
	}
	return books
}

func (sh share) covers(need share) bool {
	return sh.VCPUs >= need.VCPUs && sh.MemoryMiB >= need.MemoryMiB && sh.DiskMiB >= need.DiskMiB && sh.VMs >= need.VMs
}

func (sh share) plus(o share) share {
	return share{Resources: Resources{VCPUs: sh.VCPUs + o.VCPUs, MemoryMiB: sh.MemoryMiB + o.MemoryMiB, DiskMiB: sh.DiskMiB + o.DiskMiB},
		VMs: sh.VMs + o.VMs}
}

func (sh share) minus(o share) share {
	return sh.plus(share{Resources: Resources{VCPUs: -o.VCPUs, MemoryMiB: -o.MemoryMiB, DiskMiB: -o.DiskMiB}, VMs: -o.VMs})
}

// addLeaseSQL adds a grant to holder $2's lease of project $1 and returns
// what the lease holds.
const addLeaseSQL = `INSERT INTO quota_leases (project, holder, vcpus, memory_mib, disk_mib, vms, renewed_at)
	VALUES ($1::text, $2::text, $3::bigint, $4::bigint, $5::bigint, $6::bigint, now())
	ON CONFLICT (project, holder) DO UPDATE SET vcpus = quota_leases.vcpus + excluded.vcpus,
		memory_mib = quota_leases.memory_mib + excluded.memory_mib, disk_mib = quota_leases.disk_mib + excluded.disk_mib,
		vms = quota_leases.vms + excluded.vms, renewed_at = excluded.renewed_at
	RETURNING vcpus, memory_mib, disk_mib, vms`

// leaseFor splits a batch into the reservations whose projects' leases
// (granted now if the book lacks them) cover them, and the rest.
func (s *Store) leaseFor(ctx context.Context, book *leaseBook, batch []pendingReservation) (leased, alone []pendingReservation) {
	need := map[string]share{}
	for _, p := range batch {
		need[p.vm.Project] = need[p.vm.Project].plus(vmShare(p.vm))
	}
	covered := map[string]bool{}
	for project, n := range need {
		if !book.left[project].covers(n) {
			s.grantLease(ctx, book, project, n)
		}
		covered[project] = book.left[project].covers(n)
	}
	for _, p := range batch {
		if covered[p.vm.Project] {
			leased = append(leased, p)
		} else {
			alone = append(alone, p)
		}
	}
	return leased, alone
}

// grantLease asks project for leaseGrowth times need for book's holder,
// in one transaction: the holder's lease row first, then the project's row
// locked and read, then the grant (per resource what is asked, but never
// more than a quarter of what is left under a quota, and nothing unless
// that still covers need) added to the project's usage and to the lease.
// A refusal (too little left) or an error leaves the book as it was: the
// batch then runs on the project's row.
func (s *Store) grantLease(ctx context.Context, book *leaseBook, project string, need share) {
	want := share{Resources: Resources{VCPUs: need.VCPUs * leaseGrowth, MemoryMiB: need.MemoryMiB * leaseGrowth,
		DiskMiB: need.DiskMiB * leaseGrowth}, VMs: need.VMs * leaseGrowth}
	var (
		got     share
		granted bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		granted = false
		if err := tx.Exec(`SELECT 1 FROM quota_leases WHERE project = ? AND holder = ? FOR UPDATE`, project, book.holder).Error; err != nil {
			return err
		}
		var (
			q    Quotas
			used share
		)
		if err := tx.Raw(`SELECT quota_vcpus, quota_memory_mib, quota_disk_mib, quota_vms, used_vcpus, used_memory_mib, used_disk_mib, used_vms
			FROM projects WHERE name = ? FOR NO KEY UPDATE`, project).Row().
			Scan(&q.VCPUs, &q.MemoryMiB, &q.DiskMiB, &q.VMs, &used.VCPUs, &used.MemoryMiB, &used.DiskMiB, &used.VMs); err != nil {
			return err
		}
		grant := share{Resources: Resources{VCPUs: leaseShare(want.VCPUs, q.VCPUs, used.VCPUs),
			MemoryMiB: leaseShare(want.MemoryMiB, q.MemoryMiB, used.MemoryMiB), DiskMiB: leaseShare(want.DiskMiB, q.DiskMiB, used.DiskMiB)},
			VMs: leaseShare(want.VMs, q.VMs, used.VMs)}
		if !grant.covers(need) {
			return nil
		}
		// The CHECKs still guard the project's row.
		if err := tx.Exec(chargeProjectSQL, grant.VCPUs, grant.MemoryMiB, grant.DiskMiB, grant.VMs, project, 0, 0).Error; err != nil {
			return err
		}
		sqlTx, ok := tx.Statement.ConnPool.(*sql.Tx)
		if !ok {
			return fmt.Errorf("grant quota lease: want a *sql.Tx, got %T", tx.Statement.ConnPool)
		}
		if err := sqlTx.QueryRowContext(ctx, addLeaseSQL, project, book.holder, grant.VCPUs, grant.MemoryMiB, grant.DiskMiB, grant.VMs).
			Scan(&got.VCPUs, &got.MemoryMiB, &got.DiskMiB, &got.VMs); err != nil {
			return err
		}
		granted = true
		return nil
	})
	s.statements.Add(4)
	switch {
	case err != nil:
		s.log.Debug("quota lease grant failed; the batch runs on the project's row", "project", project, "err", err)
	case granted:
		book.left[project] = got
	default:
		s.log.Debug("no quota lease: too little left under the project's quota", "project", project, "holder", book.holder)
	}
}

// leaseShare is what a grant gives of one resource: want, but under a
// quota never more than a quarter of what is left.
func leaseShare(want int64, quota *int64, used int64) int64 {
	if quota == nil {
		return want
	}
	return min(want, (*quota-used)/4)
}

// readLeases reads book's leases again (after a batch failed, maybe
// because a reclaim took one away).
func (s *Store) readLeases(ctx context.Context, book *leaseBook) {
	clear(book.left)
	rows, err := s.db.WithContext(ctx).Raw(`SELECT project, vcpus, memory_mib, disk_mib, vms FROM quota_leases WHERE holder = ?`,
		book.holder).Rows()
	if err != nil {
		return
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			project string
			sh      share
		)
		if rows.Scan(&project, &sh.VCPUs, &sh.MemoryMiB, &sh.DiskMiB, &sh.VMs) == nil {
			book.left[project] = sh
		}
	}
}

// reclaimLeases gives the leases of project back to it inside tx, those
// of holders only, or all when holders is nil: the leases in holder
// order, which are deleted, then the project's row (the order of every
// writer). Their holders' next batches find them short, run those
// reservations alone and read their books again.
func reclaimLeases(tx *gorm.DB, project string, holders []string) error {
	held, err := takeLeases(tx, project, holders)
	if err != nil {
		return err
	}
	return creditProject(tx, project, held)
}

// takeLeases deletes the leases of project (of holders only, or all when
// holders is nil) inside tx and returns what they held, which the caller
// gives back to the project's row.
func takeLeases(tx *gorm.DB, project string, holders []string) (share, error) {
	which, args := "project = ?", []any{project}
	if holders != nil {
		which, args = "project = ? AND holder IN ?", []any{project, holders}
	}
	var held share
	if err := tx.Raw(`SELECT COALESCE(SUM(vcpus), 0), COALESCE(SUM(memory_mib), 0), COALESCE(SUM(disk_mib), 0), COALESCE(SUM(vms), 0)
		FROM (SELECT * FROM quota_leases WHERE `+which+` ORDER BY holder FOR UPDATE) AS leases`, args...).
		Row().Scan(&held.VCPUs, &held.MemoryMiB, &held.DiskMiB, &held.VMs); err != nil {
		return share{}, fmt.Errorf("read quota leases of project %q: %w", project, err)
	}
	if err := tx.Exec(`DELETE FROM quota_leases WHERE `+which, args...).Error; err != nil {
		return share{}, fmt.Errorf("reclaim quota leases of project %q: %w", project, err)
	}
	return held, nil
}

// reserveReclaiming is the last word on a reservation that the project's
// row refused for a quota: in one transaction every lease of the project
// is taken back, the host and the VM's rows are reserved (the statement
// without the usage), and the project's row gets the leases back and the
// VM's usage under the quota, then the group slot. Only what is refused
// now is over the quota. The rows are locked in the order of every other
// writer: leases, host, project, group slot.
func (s *Store) reserveReclaiming(ctx context.Context, vm VM) error {
	query, args, err := reserveStatement(vm, reservation{})
	if err != nil {
		return err
	}
	return s.inTx(ctx, func(tx *gorm.DB) error {
		held, err := takeLeases(tx, vm.Project, nil)
		if err != nil {
			return err
		}
		sqlTx, ok := tx.Statement.ConnPool.(*sql.Tx)
		if !ok {
			return fmt.Errorf("reserve vm %s: want a *sql.Tx, got %T", vm.ID, tx.Statement.ConnPool)
		}
		var placed, project, lease int
		s.statements.Add(1)
		if err := sqlTx.QueryRowContext(ctx, query, args...).Scan(&placed, &project, &lease); err != nil {
			return err
		}
		if err := reservationOutcome(vm, placed, project); err != nil {
			return err
		}
		if err := creditProject(tx, vm.Project, held); err != nil {
			return err
		}
		if err := s.chargeProject(tx, vm.Project, vmShare(vm)); err != nil {
			return err
		}
		return takeGroupSlot(tx, vm)
	})
}

// leased is what the leases of each of projects hold (none on SQLite,
// whose single writer needs no leases).
func leased(db *gorm.DB, projects []string) (map[string]share, error) {
	out := map[string]share{}
	if db.Name() != DialectPostgres || len(projects) == 0 {
		return out, nil
	}
	rows, err := db.Raw(`SELECT project, SUM(vcpus), SUM(memory_mib), SUM(disk_mib), SUM(vms) FROM quota_leases
		WHERE project IN ? GROUP BY project`, projects).Rows()
	if err != nil {
		return nil, fmt.Errorf("read quota leases: %w", err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			project string
			sh      share
		)
		if err := rows.Scan(&project, &sh.VCPUs, &sh.MemoryMiB, &sh.DiskMiB, &sh.VMs); err != nil {
			return nil, fmt.Errorf("read quota leases: %w", err)
		}
		out[project] = sh
	}
	return out, rows.Err()
}

// withoutLeases makes each project's Used its VMs' usage: used_* less
// what its leases hold.
func withoutLeases(db *gorm.DB, ps []Project) error {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	held, err := leased(db, names)
	if err != nil {
		return err
	}
	for i := range ps {
		h := held[ps[i].Name]
		ps[i].Used.VCPUs -= h.VCPUs
		ps[i].Used.MemoryMiB -= h.MemoryMiB
		ps[i].Used.DiskMiB -= h.DiskMiB
		ps[i].Used.VMs -= h.VMs
	}
	return nil
}

// returnLeases gives the leases of books back to their projects (a
// closing store), as far as it can within a few seconds; what it cannot
// stays counted until a reclaim of its project.
func (s *Store) returnLeases(books []*leaseBook) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	holders := make([]string, len(books))
	for i, b := range books {
		holders[i] = b.holder
	}
	var projects []string
	if err := s.db.WithContext(ctx).Raw(`SELECT DISTINCT project FROM quota_leases WHERE holder IN ?`, holders).
		Scan(&projects).Error; err != nil {
		return
	}
	slices.Sort(projects)
	for _, project := range projects {
		err := s.inTx(ctx, func(tx *gorm.DB) error { return reclaimLeases(tx, project, holders) })
		if err != nil {
			s.log.Warn("quota leases not returned at close; a reclaim of the project returns them", "project", project, "err", err)
		}
	}
}
