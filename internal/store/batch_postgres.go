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
// VM of no group whose NICs have no IPAM address. Its statement locks only
// its host's row and inserts rows no other reservation contends for, so
// batches that lock hosts in one order cannot deadlock. A grouped VM
// (which updates its group's shared rows) or one with an address (which
// may meet another reservation of the same address) runs its statement
// alone, as concurrent as ever, so that a deadlock between batches never
// costs the deadlock timeout.
func sharesCommits(vm VM) bool {
	if vm.Group.Name != "" {
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
// reservation of one VM): one round trip and one commit for the batch.
// The statements run in the pipeline's implicit transaction, so the batch
// commits whole or not at all; when any statement fails (a name or MAC
// taken, a deadlock with another replica's batch), nothing of it stays and each reservation runs again alone,
// where its own error is told apart. A batch of one is the plain
// statement. Each reservation is as safe as alone: the same statement,
// the same conditional UPDATE and unique indexes.
func (s *Store) commitPostgres(batch []pendingReservation) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Every batch locks its hosts' rows in the same order (by name), so two
	// batches in flight at once wait for each other, never deadlock.
	slices.SortStableFunc(batch, func(a, b pendingReservation) int { return strings.Compare(a.vm.HostName, b.vm.HostName) })
	if len(batch) > 1 {
		placed, err := s.reservePipelined(ctx, batch)
		if err == nil {
			for i, p := range batch {
				if placed[i] == 1 {
					p.result <- nil
				} else {
					p.result <- fmt.Errorf("host %s: %w", p.vm.HostName, ErrNoRoom)
				}
			}
			return
		}
		s.log.Debug("reservation batch failed as a whole; each reservation runs alone", "reservations", len(batch), "err", err)
	}
	for _, p := range batch {
		p.result <- s.reserveInOneStatement(ctx, p.vm)
	}
}

// reservePipelined sends the batch's statements in one pipeline and
// returns how many VMs each placed (1 or 0).
func (s *Store) reservePipelined(ctx context.Context, batch []pendingReservation) ([]int, error) {
	var pb pgx.Batch
	// The batch's projects are locked first, in name order, and only then
	// its hosts (each statement locks its project before its host): every
	// batch and every lone reservation takes the rows in that one order.
	projects := make([]string, 0, 1)
	for _, p := range batch {
		if !slices.Contains(projects, p.vm.Project) {
			projects = append(projects, p.vm.Project)
		}
	}
	slices.Sort(projects)
	pb.Queue(`SELECT COUNT(*) FROM (SELECT name FROM projects WHERE name = ANY($1::text[]) ORDER BY name FOR UPDATE) AS locked`, projects)
	for _, p := range batch {
		query, args, err := reserveStatement(p.vm)
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
	placed := make([]int, len(batch))
	err = conn.Raw(func(driverConn any) error {
		c, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("reservation batch: want a pgx connection, got %T", driverConn)
		}
		s.statements.Add(int64(len(batch)))
		results := c.Conn().SendBatch(ctx, &pb)
		var locked int
		firstErr := results.QueryRow().Scan(&locked)
		for i := range batch {
			if err := results.QueryRow().Scan(&placed[i]); err != nil && firstErr == nil {
				firstErr = err
			}
		}
		if err := results.Close(); err != nil && firstErr == nil {
			firstErr = err
		}
		return firstErr
	})
	return placed, err
}
