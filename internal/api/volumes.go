package api

import "time"

// CodeVolumeAttached answers a delete of a volume that a VM has attached
// (409); details: volume_id, vm_id.
const CodeVolumeAttached = "volume_attached"

// ReasonVolume is the rejection of a host that does not hold the volumes
// a VM names (they live on one host; the VM goes there).
const ReasonVolume = "volume"

// Volume states.
const (
	VolumeCreating = "creating"
	VolumeReady    = "ready"
	VolumeDeleting = "deleting"
	VolumeError    = "error"
)

// VolumeSource is where a new volume's content comes from: a registered
// or built-in image (by name), or another volume of the project on the
// same host (by name or id: a copy-on-write clone). Omitted: an empty disk.
type VolumeSource struct {
	Image  string `json:"image,omitempty"`
	Volume string `json:"volume,omitempty"`
}

// VolumeCreate is the body of POST /v1/volumes.
type VolumeCreate struct {
	Name    string `json:"name"`
	Project string `json:"project,omitempty"`
	SizeMiB int64  `json:"size_mib"`
	// Host pins the volume; empty: the scheduler places it by disk.
	Host   string            `json:"host,omitempty"`
	Source *VolumeSource     `json:"source,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
}

// VolumePatch is the body of PATCH /v1/volumes/{id}: a larger size_mib
// grows the volume (never shrinks), labels replace the labels.
type VolumePatch struct {
	SizeMiB *int64             `json:"size_mib,omitempty"`
	Labels  *map[string]string `json:"labels,omitempty"`
}

// VolumeResize is the body of POST /v1/volumes/{id}/resize.
type VolumeResize struct {
	SizeMiB int64 `json:"size_mib"`
}

// Volume is a volume: a qcow2 disk on one host that outlives its VMs.
type Volume struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Project string `json:"project"`
	SizeMiB int64  `json:"size_mib"`
	Host    string `json:"host"`
	// Source is what it was made from (nil: empty).
	Source *VolumeSource     `json:"source,omitempty"`
	Labels map[string]string `json:"labels"`
	State  string            `json:"state"`
	Reason string            `json:"reason,omitempty"`
	// Serial is the virtio serial a guest sees; Device its stable path
	// in the guest (/dev/disk/by-id/virtio-<serial>).
	Serial     string             `json:"serial"`
	Device     string             `json:"device"`
	AttachedTo []VolumeAttachment `json:"attached_to"`
	Placement  *Placement         `json:"placement,omitempty"`
	CreatedAt  time.Time          `json:"created_at"`
}

// VolumeAttachment is one VM a volume is attached to.
type VolumeAttachment struct {
	VMID     string `json:"vm_id"`
	ReadOnly bool   `json:"read_only"`
	// State is attached, attaching or detaching (volume_attach.go).
	State string `json:"state,omitempty"`
}

// VMVolume is a volume of a VM: in a create by name or id (Volume), in an
// answer with its id, serial and device filled in.
type VMVolume struct {
	Volume   string `json:"volume"`
	ReadOnly bool   `json:"read_only"`
	VolumeID string `json:"volume_id,omitempty"`
	Serial   string `json:"serial,omitempty"`
	Device   string `json:"device,omitempty"`
	// State is attached, attaching or detaching (answers only).
	State string `json:"state,omitempty"`
}
