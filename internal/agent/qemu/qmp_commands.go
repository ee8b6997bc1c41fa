package qemu

// The QMP commands the driver uses, by name, with typed arguments and
// answers (qmp.go has the session).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// qmpStatus is the answer of query-status.
type qmpStatus struct {
	Running bool   `json:"running"`
	Status  string `json:"status"`
}

// queryStatus asks for the VM's run state.
func (q *monitor) queryStatus(ctx context.Context) (qmpStatus, error) {
	var st qmpStatus
	err := q.run(ctx, "query-status", nil, &st)
	return st, err
}

// stop pauses the vCPUs. QEMU answers once they are stopped (its STOP event
// comes before the answer), so there is nothing to wait for after it.
func (q *monitor) stop(ctx context.Context) error { return q.run(ctx, "stop", nil, nil) }

// cont continues the vCPUs; like stop, QEMU answers once they run (RESUME).
func (q *monitor) cont(ctx context.Context) error { return q.run(ctx, "cont", nil, nil) }

// quit ends QEMU.
func (q *monitor) quit(ctx context.Context) error { return q.run(ctx, "quit", nil, nil) }

// powerdown presses the guest's ACPI power button.
func (q *monitor) powerdown(ctx context.Context) error {
	return q.run(ctx, "system_powerdown", nil, nil)
}

// blockResize grows the disk of drive device to size bytes.
func (q *monitor) blockResize(ctx context.Context, device string, size int64) error {
	return q.run(ctx, "block_resize", map[string]any{"device": device, "size": size}, nil)
}

// qmpBlock is one drive of query-block.
type qmpBlock struct {
	Device   string `json:"device"`
	Inserted *struct {
		NodeName string `json:"node-name"`
		File     string `json:"file"`
		Image    struct {
			VirtualSize int64 `json:"virtual-size"`
		} `json:"image"`
	} `json:"inserted"`
}

// queryBlock lists the VM's drives.
func (q *monitor) queryBlock(ctx context.Context) ([]qmpBlock, error) {
	var blocks []qmpBlock
	err := q.run(ctx, "query-block", nil, &blocks)
	return blocks, err
}

// blockdevSnapshotSync moves drive device onto file, an existing qcow2
// overlay of its current file, as node node; the old file is reopened
// read-only.
func (q *monitor) blockdevSnapshotSync(ctx context.Context, device, file, node string) error {
	return q.run(ctx, "blockdev-snapshot-sync", map[string]any{
		"device": device, "snapshot-file": file, "snapshot-node-name": node, "format": "qcow2", "mode": "existing",
	}, nil)
}

// migrateSetMaxBandwidth sets the migration rate limit, in bytes/s.
func (q *monitor) migrateSetMaxBandwidth(ctx context.Context, bytesPerSecond int64) error {
	return q.run(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": bytesPerSecond}, nil)
}

// migrationCapability is one migration capability and its state.
type migrationCapability struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

// migrateSetCapabilities sets migration capabilities, in the order given.
func (q *monitor) migrateSetCapabilities(ctx context.Context, caps ...migrationCapability) error {
	return q.run(ctx, "migrate-set-capabilities", map[string]any{"capabilities": caps}, nil)
}

// getfd hands QEMU a descriptor of f under name, for a later "fd:<name>"
// migration URI. QEMU keeps its own copy (the caller closes f) and closes
// it when the migration that takes it ends.
func (q *monitor) getfd(ctx context.Context, name string, f *os.File) error {
	return q.runWith(ctx, f, "getfd", map[string]any{"fdname": name}, nil)
}

// migrate starts an outgoing migration to uri; waitMigration follows it.
func (q *monitor) migrate(ctx context.Context, uri string) error {
	return q.run(ctx, "migrate", map[string]any{"uri": uri}, nil)
}

// migrateIncoming starts loading a migration from uri into a QEMU started
// with -incoming defer; waitMigration follows it.
func (q *monitor) migrateIncoming(ctx context.Context, uri string) error {
	return q.run(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil)
}

// migrateCancel stops an outgoing migration.
func (q *monitor) migrateCancel(ctx context.Context) error {
	return q.run(ctx, "migrate_cancel", nil, nil)
}

// qmpMigration is the answer of query-migrate.
type qmpMigration struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
}

// queryMigrate asks for the state of the current migration.
func (q *monitor) queryMigrate(ctx context.Context) (qmpMigration, error) {
	var info qmpMigration
	err := q.run(ctx, "query-migrate", nil, &info)
	return info, err
}

// waitMigration waits, up to timeout, for the MIGRATION event that ends the
// migration the session started (the capability "events" must be on) and
// returns its final status: completed, failed or cancelled.
func (q *monitor) waitMigration(ctx context.Context, timeout time.Duration) (string, error) {
	var status string
	_, err := q.waitEvent(ctx, timeout, func(e qmpEvent) bool {
		if e.Event != "MIGRATION" {
			return false
		}
		var data struct {
			Status string `json:"status"`
		}
		if json.Unmarshal(e.Data, &data) != nil {
			return false
		}
		switch data.Status {
		case "completed", "failed", "cancelled":
			status = data.Status
			return true
		}
		return false
	})
	if err != nil {
		return "", fmt.Errorf("wait for the migration to end: %w", err)
	}
	return status, nil
}
