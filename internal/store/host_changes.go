package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"

	"gorm.io/gorm"
)

// HostCursor marks how far a reader of HostChanges has seen the hosts
// table. The zero cursor has seen nothing.
type HostCursor struct {
	// xmin is, on PostgreSQL, the oldest transaction that was still
	// running when the last read took its snapshot: every row version
	// written by an older transaction was visible to that read.
	xmin  uint64
	valid bool
}

// HostChanges is what changed in the hosts table since a cursor.
type HostChanges struct {
	// Full says Hosts is every host (and Deleted empty): the cursor was
	// zero, or the database cannot tell what changed (SQLite).
	Full bool
	// Hosts are the rows written since the cursor (a row may be one the
	// reader already saw: a read overlaps the one before it), with the
	// columns a host view reads only (viewColumns): the others are zero.
	Hosts []Host
	// Deleted are hosts deleted since the cursor (their tombstones); a
	// name registered again after its delete is in Hosts too.
	Deleted []string
	// Next is the cursor for the next call.
	Next HostCursor
}

// HostChanges returns the hosts written and deleted since cur, so that a
// host view can be refreshed with what changed instead of reloading every
// host.
//
// On PostgreSQL every row version carries the id of the transaction that
// wrote it (xmin). One REPEATABLE READ transaction reads the snapshot's
// xmin (every older transaction has ended and is visible to it) and the
// rows written by that transaction or newer ones; the next call starts
// there. A transaction still running at the snapshot has an id at least
// that xmin, so its rows come in the next read: nothing committed is
// missed, whatever the commit order. Deletes come from the tombstones
// DeleteHost writes (deleted_hosts). Ids are compared with age(), which
// holds across wraparound for the 2^31 transactions that a cursor can be
// behind (the caller reloads everything far more often than that).
//
// On SQLite there is no such id: Full, every host.
func (s *Store) HostChanges(ctx context.Context, cur HostCursor) (HostChanges, error) {
	if s.dialect != DialectPostgres {
		hs, err := viewHosts(s.db.WithContext(ctx), "")
		if err != nil {
			return HostChanges{}, fmt.Errorf("read hosts: %w", err)
		}
		return HostChanges{Full: true, Hosts: hs}, nil
	}
	var out HostChanges
	err := s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		out = HostChanges{}
		var snap string
		if err := tx.Raw("SELECT pg_snapshot_xmin(pg_current_snapshot())::text").Scan(&snap).Error; err != nil {
			return fmt.Errorf("read snapshot: %w", err)
		}
		xmin, err := strconv.ParseUint(snap, 10, 64)
		if err != nil {
			return fmt.Errorf("read snapshot: xmin %q: %w", snap, err)
		}
		out.Next = HostCursor{xmin: xmin, valid: true}
		if !cur.valid {
			out.Full = true
			out.Hosts, err = viewHosts(tx, "")
			return err
		}
		// xid is 32 bits: the cursor's low half, compared by age.
		since := strconv.FormatUint(cur.xmin%(1<<32), 10)
		if out.Hosts, err = viewHosts(tx, "WHERE age(xmin) <= age(?::xid)", since); err != nil {
			return fmt.Errorf("read changed hosts: %w", err)
		}
		if err := tx.Raw("SELECT DISTINCT name FROM deleted_hosts WHERE age(xmin) <= age(?::xid)", since).Scan(&out.Deleted).Error; err != nil {
			return fmt.Errorf("read deleted hosts: %w", err)
		}
		return nil
	}, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return HostChanges{}, fmt.Errorf("read host changes: %w", err)
	}
	return out, nil
}

// viewColumns are the columns of hosts that a host view reads.
const viewColumns = `name, address, agent_key, labels, images, alive, schedulable, drain_state,
	total_vcpus, total_memory_mib, total_disk_mib, cap_vcpus, cap_memory_mib, cap_disk_mib,
	cpu_allocation_ratio, memory_reserved_mib, alloc_vcpus, alloc_memory_mib, alloc_disk_mib, underlay_address`

// viewHosts reads viewColumns of the hosts that where selects, scanned by
// hand: at 100,000 hosts gorm's reflection per row was most of a reload.
func viewHosts(db *gorm.DB, where string, args ...any) ([]Host, error) {
	rows, err := db.Raw("SELECT "+viewColumns+" FROM hosts "+where, args...).Rows()
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var out []Host
	var labels, images string
	for rows.Next() {
		var h Host
		if err := rows.Scan(&h.Name, &h.Address, &h.AgentKey, &labels, &images, &h.Alive, &h.Schedulable, &h.Drain.State,
			&h.Total.VCPUs, &h.Total.MemoryMiB, &h.Total.DiskMiB, &h.Capacity.VCPUs, &h.Capacity.MemoryMiB, &h.Capacity.DiskMiB,
			&h.CPUAllocationRatio, &h.MemoryReservedMiB, &h.Allocated.VCPUs, &h.Allocated.MemoryMiB, &h.Allocated.DiskMiB,
			&h.UnderlayAddress); err != nil {
			return nil, err
		}
		if err := json.Unmarshal([]byte(labels), &h.Labels); err != nil {
			return nil, fmt.Errorf("host %s: labels: %w", h.Name, err)
		}
		if err := json.Unmarshal([]byte(images), &h.Images); err != nil {
			return nil, fmt.Errorf("host %s: images: %w", h.Name, err)
		}
		out = append(out, h)
	}
	return out, rows.Err()
}
