package store

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// postgresCommitters is how many batches of reservations may be in flight
// on PostgreSQL at once: more than one, so that a batch is being collected
// while the previous one commits; few, so that batches stay large.
const postgresCommitters = 2

// sharesCommits says whether a reservation on PostgreSQL joins a batch: a
// VM of no group and no volumes whose NICs have no IPAM address. Its statement locks only
// its host's row and inserts rows no other reservation contends for, so
// batches that lock hosts in one order cannot deadlock. A grouped VM
// (which updates its group's shared rows) or one with an address (which
// may meet another reservation of the same address) runs its statement
// alone, as concurrent as ever, so that a deadlock between batches never
// costs the deadlock timeout.
func sharesCommits(vm VM) bool {
	if vm.Group.Name != "" || len(vm.Volumes) > 0 {
		return false
	}
	for _, n := range vm.NICs {
		if n.Address != 0 {
			return false
		}
	}
	return true
}

// commitPostgres commits a batch of reservations on PostgreSQL as one
// pipeline of reservation statements (reserveStatement, each the whole
// reservation of one VM, its usage spent from the committer's quota lease;
// quota_leases.go): one round trip and one commit for the batch. The
// statements run in the pipeline's implicit transaction, so the batch
// commits whole or not at all; when any statement fails (a name or MAC
// taken, a deadlock with another replica's batch), nothing of it stays and
// each reservation runs again alone, where its own error is told apart. A
// reservation whose lease did not cover it (a reclaim took the lease), or
// whose project grants no lease (too little left under a quota), runs
// alone too. Each reservation is as safe as alone: the same conditional
// UPDATE, unique indexes and quota CHECKs.
func (s *Store) commitPostgres(committer int, batch []pendingReservation) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Every batch locks its hosts' rows in the same order (by name), so two
	// batches in flight at once wait for each other, never deadlock.
	slices.SortStableFunc(batch, func(a, b pendingReservation) int { return strings.Compare(a.vm.HostName, b.vm.HostName) })
	book := s.leases[committer]
	leased, alone := s.leaseFor(ctx, book, batch)
	if len(leased) > 0 {
		outcomes, err := s.reservePipelined(ctx, book, leased)
		if err == nil {
			short := false
			for i, p := range leased {
				o := outcomes[i]
				if o.lease == 0 {
					// The lease did not cover it (a reclaim took it): alone.
					short = true
					alone = append(alone, p)
					continue
				}
				err := reservationOutcome(p.vm, o.placed, o.project)
				if err == nil {
					book.left[p.vm.Project] = book.left[p.vm.Project].minus(vmShare(p.vm))
				}
				p.result <- err
			}
			if short {
				s.readLeases(ctx, book)
			}
		} else {
			s.log.Debug("reservation batch failed as a whole; each reservation runs alone", "reservations", len(leased), "err", err)
			s.readLeases(ctx, book)
			alone = append(alone, leased...)
		}
	}
	for _, p := range alone {
		p.result <- s.reserveInOneStatement(ctx, p.vm)
	}
}

// statementOutcome is what one reservation statement of a batch did: VMs
// placed (1 or 0), whether it found its project (1 or 0) and whether its
// lease covered it (1 or 0).
type statementOutcome struct{ placed, project, lease int }

// reservePipelined sends the batch's statements in one pipeline and
// returns what each did. Each reserves its host and inserts its VM's rows
// (hosts in name order) and spends its usage from book's lease. No
// statement of a batch writes a project's row.
func (s *Store) reservePipelined(ctx context.Context, book *leaseBook, batch []pendingReservation) ([]statementOutcome, error) {
	var pb pgx.Batch
	// Each statement locks its lease before its host. A batch of several
	// projects locks all its leases first, in project order, so that it
	// takes every lease before every host, as reclaims do (leases, then a
	// host), instead of a lease after another project's host.
	var projects []string
	for _, p := range batch {
		if !slices.Contains(projects, p.vm.Project) {
			projects = append(projects, p.vm.Project)
		}
	}
	locks := 0
	if len(projects) > 1 {
		slices.Sort(projects)
		pb.Queue(`SELECT COUNT(*) FROM (SELECT 1 FROM quota_leases WHERE holder = $1::text AND project = ANY($2::text[])
			ORDER BY project FOR UPDATE) AS locked`, book.holder, projects)
		locks = 1
	}
	for _, p := range batch {
		query, args, err := reserveStatement(p.vm, reservation{leaseHolder: book.holder})
		if err != nil {
			return nil, err
		}
		pb.Queue(query, args...)
	}
	sqlDB, err := s.db.DB()
	if err != nil {
		return nil, err
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	outcomes := make([]statementOutcome, len(batch))
	err = conn.Raw(func(driverConn any) error {
		c, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("reservation batch: want a pgx connection, got %T", driverConn)
		}
		s.statements.Add(int64(len(batch)))
		results := c.Conn().SendBatch(ctx, &pb)
		var firstErr error
		for range locks {
			var locked int
			firstErr = results.QueryRow().Scan(&locked)
		}
		for i := range batch {
			o := &outcomes[i]
			if err := results.QueryRow().Scan(&o.placed, &o.project, &o.lease); err != nil && firstErr == nil {
				firstErr = err
			}
		}
		if err := results.Close(); err != nil && firstErr == nil {
			firstErr = err
		}
		return firstErr
	})
	return outcomes, err
}
