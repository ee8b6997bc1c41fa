package agentapi

import (
	"strings"
	"time"
)

// Volume states on an agent.
const VolumeReady = "ready"

// VolumeSerial is the virtio-blk serial a guest sees volume id's disk by
// (/dev/disk/by-id/virtio-<serial>): the first 20 hex digits of the id
// with its dashes removed, the 20 bytes a virtio-blk serial holds. Volume
// ids are random (UUIDv4), so 80 bits tell the volumes of one guest apart.
func VolumeSerial(id string) string {
	s := strings.ReplaceAll(id, "-", "")
	if len(s) > 20 {
		s = s[:20]
	}
	return s
}

// VolumeSource is where a new volume's content comes from: at most one of
// Image (the disk content of an image on the agent, grown to the volume's
// size), Volume (a copy-on-write clone of another volume on the same
// agent) and Peer (a move: the volume pulled from another agent). None:
// an empty disk.
//
// With Snapshot (a fork child's volume), Volume names a volume of that
// snapshot (SnapshotVolume.ID) and the new volume starts from the frozen
// point the snapshot took of it: a copy-on-write clone of it on the
// snapshot's agent, or with Peer a copy pulled from the snapshot's agent
// (GET /v1/snapshots/{snapshot}/volumes/{volume}/content).
type VolumeSource struct {
	Image    string      `json:"image,omitempty"`
	Volume   string      `json:"volume,omitempty"`
	Snapshot string      `json:"snapshot,omitempty"`
	Peer     *VolumePeer `json:"peer,omitempty"`
}

// SnapshotVolume is a volume attached to a VM when it was snapshotted.
// A read-write one has a frozen point in the snapshot, taken in the same
// paused window as the memory (Frozen); the children of a fork get a
// clone of it each. A read-only one has none: the children share the
// volume itself, attached read-only. Slot is its hot-plug slot in the VM:
// a VM started from the snapshot has its volumes in the same slots, so
// that its devices match the saved state.
type SnapshotVolume struct {
	ID       string `json:"id"`
	SizeMiB  int64  `json:"size_mib"`
	ReadOnly bool   `json:"read_only"`
	Slot     int    `json:"slot"`
	Frozen   bool   `json:"frozen"`
}

// VolumePeer is the agent a moved volume is pulled from (the same volume
// id there, detached): its address, its identity key as the control plane
// pinned it (EncodeKey; the token goes only to an agent that proves it),
// and optionally the sha256 of its GET /v1/volumes/{id}/content, which
// the pull checks while it streams (without it: the digest the source
// sends with the content).
type VolumePeer struct {
	Agent     string `json:"agent"`
	PublicKey string `json:"public_key"`
	Digest    string `json:"digest,omitempty"`
}

// VolumeSpec is the body of PUT /v1/volumes/{id}: create the volume with
// that id. The same id with the same spec again returns the volume.
type VolumeSpec struct {
	SizeMiB int64         `json:"size_mib"`
	Source  *VolumeSource `json:"source,omitempty"`
}

// Volume is one volume on an agent: a qcow2 disk that outlives the VMs it
// is attached to.
type Volume struct {
	ID      string `json:"id"`
	SizeMiB int64  `json:"size_mib"`
	Serial  string `json:"serial"`
	State   string `json:"state"`
	// AttachedTo is the VM the volume is attached to ("" when none; the
	// first by id when it is attached read-only to several), ReadOnly how.
	AttachedTo string `json:"attached_to"`
	ReadOnly   bool   `json:"read_only"`
	// AllocatedBytes is the host disk its own file takes now (not the
	// frozen files it shares with its clones).
	AllocatedBytes int64         `json:"allocated_bytes"`
	Source         *VolumeSource `json:"source,omitempty"`
	// CreatedAt is when the agent made the volume: the control plane
	// deletes a volume without a row only once it is older than its
	// orphan grace.
	CreatedAt time.Time `json:"created_at,omitzero"`
}

// VolumeList is the answer of GET /v1/volumes.
type VolumeList struct {
	Items []Volume `json:"items"`
}

// VolumeResize is the body of POST /v1/volumes/{id}/resize: the volume's
// new size. Volumes grow, never shrink; the same size changes nothing.
type VolumeResize struct {
	SizeMiB int64 `json:"size_mib"`
}

// VolumeAttachment is one volume of a VM: VMSpec.Volumes, and the body of
// PUT /v1/vms/{vm}/volumes/{volume} (where ID is the path's).
type VolumeAttachment struct {
	ID       string `json:"id,omitempty"`
	ReadOnly bool   `json:"read_only"`
	// Slot is the volume's hot-plug slot in the VM (in a VM's answer; a
	// create gives slots 0, 1, ... in order): a migration's target puts
	// each volume in the slot it has on the source.
	Slot int `json:"slot,omitempty"`
}
