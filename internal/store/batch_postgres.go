package store

import (
	"context"
	"fmt"
	"maps"
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
		outcomes, err := s.reservePipelined(ctx, batch)
		if err == nil {
			for i, p := range batch {
				p.result <- reservationOutcome(p.vm, outcomes[i].placed, outcomes[i].project)
			}
			return
		}
		s.log.Debug("reservation batch failed as a whole; each reservation runs alone", "reservations", len(batch), "err", err)
	}
	for _, p := range batch {
		p.result <- s.reserveInOneStatement(ctx, p.vm)
	}
}

// statementOutcome is what one reservation statement of a batch did: VMs
// placed (1 or 0) and whether it found its project (1 or 0).
type statementOutcome struct{ placed, project int }

// chargeBatchSQL adds to project $1 the usage of the batch's VMs (ids $2)
// that its statements placed: their rows are visible to it, inserted
// earlier in the same transaction. Past a quota the CHECK fails it, and
// with it the whole batch, whose reservations then run alone.
const chargeBatchSQL = `UPDATE projects SET used_vcpus = used_vcpus + placed.vcpus,
		used_memory_mib = used_memory_mib + placed.memory_mib, used_disk_mib = used_disk_mib + placed.disk_mib,
		used_vms = used_vms + placed.vms
	FROM (SELECT COALESCE(SUM(vcpus), 0) AS vcpus, COALESCE(SUM(memory_mib), 0) AS memory_mib,
			COALESCE(SUM(disk_mib), 0) AS disk_mib, COUNT(*) AS vms
		FROM vms WHERE id = ANY($2::text[]) AND project = $1::text) AS placed
	WHERE projects.name = $1::text AND placed.vms > 0`

// reservePipelined sends the batch's statements in one pipeline and
// returns what each did. The statements reserve hosts and insert VM rows
// (hosts in name order); then one UPDATE per project, in name order, adds
// what its VMs placed to its usage. Every writer locks a host before a
// project's usage row, so batches and lone statements never deadlock over
// the two, and the project's row, which every reservation of the project
// updates, is held from the batch's last statements to its commit only.
func (s *Store) reservePipelined(ctx context.Context, batch []pendingReservation) ([]statementOutcome, error) {
	var pb pgx.Batch
	ids := map[string][]string{}
	for _, p := range batch {
		query, args, err := reserveStatement(p.vm, false)
		if err != nil {
			return nil, err
		}
		pb.Queue(query, args...)
		ids[p.vm.Project] = append(ids[p.vm.Project], p.vm.ID)
	}
	projects := slices.Sorted(maps.Keys(ids))
	for _, project := range projects {
		pb.Queue(chargeBatchSQL, project, ids[project])
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
		for i := range batch {
			if err := results.QueryRow().Scan(&outcomes[i].placed, &outcomes[i].project); err != nil && firstErr == nil {
				firstErr = err
			}
		}
		for range projects {
			if _, err := results.Exec(); err != nil && firstErr == nil {
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
