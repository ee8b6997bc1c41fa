package api

// VMMigrate is the body of POST /v1/vms/{id}/migrate. Host names the
// target; empty, the scheduler chooses it with the VM's own constraints.
type VMMigrate struct {
	Host string `json:"host,omitempty"`
}

// Migration states (VM.Migration.State).
const (
	MigrationReserved = "reserved" // the target's capacity is held; nothing moved yet
	MigrationMoving   = "moving"   // the VM streams from the source to the target
	MigrationSwitched = "switched" // the VM runs on the target; the source's copy is being deleted
)

// VMMigration is a VM's migration while it runs (VM.Migration).
type VMMigration struct {
	State  string `json:"state"`
	Source string `json:"source"`
	Target string `json:"target"`
	// Live: the VM moves running (memory pre-copy, then a short pause);
	// otherwise it is stopped and moves as files (cold).
	Live bool `json:"live"`
	// Phase is the agent's phase (setup, files, disk, memory,
	// stop-and-copy, switch, done); Transferred and Total in bytes (memory
	// and disk together), 0 until the source reports.
	Phase       string `json:"phase,omitempty"`
	Transferred int64  `json:"transferred_bytes"`
	Total       int64  `json:"total_bytes"`
	// Drain names the host whose drain started it ("" for a migration a
	// user asked for).
	Drain string `json:"drain,omitempty"`
}

// Host drain states (Host.Drain.State).
const (
	DrainNone       = ""
	DrainDraining   = "draining"
	DrainDrained    = "drained"
	DrainIncomplete = "incomplete"
)

// HostDrain is a host's drain: POST /v1/hosts/{name}/drain marks the host
// unschedulable for new VMs and migrates its VMs off it, a few at a time;
// POST /v1/hosts/{name}/undrain puts it back in service.
type HostDrain struct {
	// State: "" (in service), draining, drained (no VM left), incomplete
	// (the pass ended with VMs it could not move: Failed says why).
	State string `json:"state"`
	// Total is how many VMs the host had when the drain started, Moved
	// how many left it since, Remaining how many it holds now.
	Total     int64          `json:"total"`
	Moved     int64          `json:"moved"`
	Remaining int64          `json:"remaining"`
	Failed    []DrainFailure `json:"failed"`
}

// DrainFailure is a VM a drain could not move, and why.
type DrainFailure struct {
	VM     string `json:"vm"`
	Reason string `json:"reason"`
}
