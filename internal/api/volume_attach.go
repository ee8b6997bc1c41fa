package api

// MaxVMVolumes is the most volumes one VM can have attached (its agent
// gives each a PCIe root port of its own).
const MaxVMVolumes = 8

// Attachment states: how far a VM's volume got. A VM answer lists every
// attachment; only attached ones are on the VM. attaching and detaching
// last for the agent call, or, when a control replica stopped in the
// middle, until the host monitor settles them against the agent (a few
// sync intervals once the replica's lease lapsed).
const (
	AttachmentAttached  = "attached"
	AttachmentAttaching = "attaching"
	AttachmentDetaching = "detaching"
)

// VMVolumeAttach is the body of POST /v1/vms/{id}/volumes: attach a ready
// volume (a name or an id in the VM's project) to an existing VM, hot when
// it runs, at its next start when it is stopped.
type VMVolumeAttach struct {
	Volume   string `json:"volume"`
	ReadOnly bool   `json:"read_only,omitempty"`
}
