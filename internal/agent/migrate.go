package agent

// Migration of a VM to another agent. The control plane prepares the VM on the target (PUT
// /v1/vms/{id}/incoming, migrate_incoming.go), then starts the migration
// on the source (POST /v1/vms/{id}/migrate, migrate_source.go). The
// source streams the VM to the target over connections it opens to the
// target's agent (migrate_stream.go): one per channel, each an HTTP request
// upgraded to a raw stream, on which the source proves the identity the
// control plane pinned for it before anything moves. Nothing listens on
// TCP for a VMM: each agent bridges its VMM's unix socket to the stream.
//
// Exactly one copy runs: the target keeps the VM paused (incoming) until
// the source, whose VMM reported the stream completed and is stopped for
// good (migrated), commits it (POST /v1/vms/{id}/incoming/commit). A
// migration that fails before that leaves the VM running on the source
// and the target's copy failed, never run.

import (
	"context"
	"net"
	"slices"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// Migrator is a Driver that can move a VM to another agent. The agent owns
// the records, the channels and the commit; the driver runs its VMM's end
// of each channel.
type Migrator interface {
	// MigrationFiles names the files of m.Dir the VM's own files channel
	// carries beside those the agent moves (its seed, its UEFI variables):
	// for a cold migration (live false) its disk files; for a live one the
	// files the target's VMM needs before the stream starts (none for a
	// disk that moves by mirror).
	MigrationFiles(m *Machine, live bool) ([]string, error)
	// AdoptIncomingFiles checks and adopts the files a cold migration
	// brought into m.Dir before anything opens them: a disk may sit only
	// on the base disk of m's image on this agent, and the driver rewrites
	// its backing file name to this agent's file.
	AdoptIncomingFiles(ctx context.Context, m *Machine, files []string) error
	// PrepareIncoming starts m's VMM waiting for a live stream (its disk
	// made by Create), paused; it sets m.Process and fills the host ports
	// of m's port forwards, as Boot.
	PrepareIncoming(ctx context.Context, m *Machine) error
	// Receive runs the target's end of one channel (ChannelMemory,
	// ChannelDisk) of m's stream on conn, until the source ends it.
	Receive(ctx context.Context, m *Machine, channel string, conn net.Conn) error
	// IncomingState says where m's incoming live stream is: IncomingActive,
	// IncomingCompleted (everything arrived, the VM is paused) or
	// IncomingFailed (with why; the VMM is gone or will not run).
	IncomingState(ctx context.Context, m *Machine) (state, reason string)
	// MigrateOut moves running m live to the target, whose channels
	// out.Dial opens. It returns once the VMM completed the stream (m is
	// then stopped for good: its VMM never runs the guest again unless
	// ResumeOutgoing is called) or failed; on failure or when ctx ends
	// (cancel), the VM runs on the source as before.
	MigrateOut(ctx context.Context, m *Machine, out MigrateOut) (agentapi.Migration, error)
	// OutgoingState is what m's VMM says of its last outgoing migration
	// (after an agent restart): OutgoingNone, OutgoingActive,
	// OutgoingCompleted, OutgoingFailed; with its figures.
	OutgoingState(ctx context.Context, m *Machine) (string, agentapi.Migration)
	// ResumeOutgoing runs m again on the source after its stream
	// completed but the target holds no running copy (it failed or was
	// discarded before it was committed).
	ResumeOutgoing(ctx context.Context, m *Machine) error
}

// MigrateOut is what a Migrator needs to move a VM.
type MigrateOut struct {
	// Dial opens one channel of the stream to the target, authenticated.
	Dial func(ctx context.Context, channel string) (net.Conn, error)
	// Progress receives the migration's figures as they change.
	Progress func(agentapi.Migration)
	// MaxDowntime is the longest pause the switch may take.
	MaxDowntime time.Duration
	// Converge is how long pre-copy may take before the migration is
	// cancelled as not converging (the VM keeps running on the source).
	Converge time.Duration
}

// Incoming stream states (Migrator.IncomingState).
const (
	IncomingActive    = "active"
	IncomingCompleted = "completed"
	IncomingFailed    = "failed"
)

// Outgoing migration states (Migrator.OutgoingState).
const (
	OutgoingNone      = "none"
	OutgoingActive    = "active"
	OutgoingCompleted = "completed"
	OutgoingFailed    = "failed"
)

const (
	// defaultMaxDowntime is QEMU's own default downtime-limit.
	defaultMaxDowntime = 300 * time.Millisecond
	// defaultMigrationTimeout bounds a whole migration.
	defaultMigrationTimeout = 10 * time.Minute
)

// CommitTimeout bounds one round of the source's attempts to commit the
// target (a variable for tests); a source that gives up keeps trying in
// the background.
var CommitTimeout = 2 * time.Minute

// Reasons of refused migrations (the details of the 409, key "reason").
const (
	ReasonMigrationDriver    = "driver"
	ReasonMigrationVolumes   = "volumes"
	ReasonMigrationForkChild = "fork-child"
	ReasonMigrationSnapshot  = "snapshot-chain"
	ReasonMigrationState     = "state"
)

// migrationVerbs are the operations (lockVM's what) of a migration itself,
// which a VM in a migration state takes.
var migrationVerbs = map[string]bool{
	"migrate": true, "be committed": true, "receive migrated files": true, "cancel its migration": true,
}

func (a *Agent) migrator() (Migrator, error) {
	mg, ok := a.cfg.Driver.(Migrator)
	if !ok {
		e := errConflict("the %s driver of this agent cannot migrate vms", a.cfg.Driver.Name())
		e.Details = map[string]any{"reason": ReasonMigrationDriver}
		return nil, e
	}
	return mg, nil
}

// migrationRefusal is the 409 of a VM that cannot move, with its reason.
func migrationRefusal(id, reason, format string, args ...any) *Error {
	e := errConflict(format, args...)
	e.Details = map[string]any{"vm": id, "reason": reason}
	return e
}

// checkMovable refuses a VM the agent cannot move (either end): a
// read-only volume (which other VMs may share) stays on its host, and a VM
// whose disk sits on a snapshot's frozen disk needs that snapshot on the
// target, which a migration does not carry yet. Read-write volumes move
// with the VM: the control plane gives the target a copy of each first
// (empty for a live migration, which mirrors them; pulled for a cold one).
func checkMovable(id string, volumes []agentapi.VolumeAttachment, snapshot, disk string) error {
	ro := slices.IndexFunc(volumes, func(v agentapi.VolumeAttachment) bool { return v.ReadOnly })
	switch {
	case ro >= 0:
		return migrationRefusal(id, ReasonMigrationVolumes,
			"vm %s has volume %s attached read-only: read-only volumes (which other vms may share) do not move with a migration; detach it first", id, volumes[ro].ID)
	case snapshot != "":
		return migrationRefusal(id, ReasonMigrationForkChild,
			"vm %s was started from snapshot %s (a fork child): its disk sits on that snapshot, which a migration does not move; it cannot migrate", id, snapshot)
	case disk != "":
		return migrationRefusal(id, ReasonMigrationSnapshot,
			"vm %s was snapshotted: its disk (%s) sits on the snapshot's frozen disk, which a migration does not move; it cannot migrate", id, disk)
	}
	return nil
}
