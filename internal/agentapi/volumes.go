package agentapi

import (
	"context"
	"net/http"
	"net/url"
	"strings"
)

// Volume states on an agent.
const VolumeReady = "ready"

// VolumeSource is where a new volume's content comes from: an image of
// the agent (by name) or another volume on the same agent (a
// copy-on-write clone). Neither: an empty disk.
type VolumeSource struct {
	Image  string `json:"image,omitempty"`
	Volume string `json:"volume,omitempty"`
}

// VolumeSpec is the body of PUT /v1/volumes/{id}.
type VolumeSpec struct {
	SizeMiB int64         `json:"size_mib"`
	Source  *VolumeSource `json:"source,omitempty"`
}

// Volume is a volume as an agent has it.
type Volume struct {
	ID             string `json:"id"`
	SizeMiB        int64  `json:"size_mib"`
	Serial         string `json:"serial"`
	State          string `json:"state"`
	AttachedTo     string `json:"attached_to"`
	ReadOnly       bool   `json:"read_only"`
	AllocatedBytes int64  `json:"allocated_bytes"`
}

// VolumeList is the answer of GET /v1/volumes.
type VolumeList struct {
	Items []Volume `json:"items"`
}

// VolumeResize is the body of POST /v1/volumes/{id}/resize.
type VolumeResize struct {
	SizeMiB int64 `json:"size_mib"`
}

// VolumeAttachment is one volume of a VM: in VMSpec.Volumes (by id) and
// the body of PUT /v1/vms/{vm}/volumes/{vol} (ID empty there).
type VolumeAttachment struct {
	ID       string `json:"id,omitempty"`
	ReadOnly bool   `json:"read_only"`
}

// VolumeSerial is the virtio-blk serial of volume id: the first 20 hex
// digits of the id without its dashes (a serial holds 20 bytes). The guest
// sees the disk as /dev/disk/by-id/virtio-<serial>.
func VolumeSerial(id string) string {
	s := strings.ReplaceAll(id, "-", "")
	if len(s) > 20 {
		s = s[:20]
	}
	return s
}

// CreateVolume makes the volume with this id, or returns it when it exists
// with the same spec (ErrConflict: with another spec).
func (c *Client) CreateVolume(ctx context.Context, id string, spec VolumeSpec) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodPut, "/v1/volumes/"+url.PathEscape(id), spec, &out, 6*c.timeout)
	return out, err
}

// GetVolume returns one volume; ErrNotFound when the agent has none.
func (c *Client) GetVolume(ctx context.Context, id string) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodGet, "/v1/volumes/"+url.PathEscape(id), nil, &out, c.timeout)
	return out, err
}

// ListVolumes returns every volume on the agent.
func (c *Client) ListVolumes(ctx context.Context) ([]Volume, error) {
	var out VolumeList
	err := c.do(ctx, http.MethodGet, "/v1/volumes", nil, &out, c.timeout)
	return out.Items, err
}

// DeleteVolume removes the volume and its files; an unknown id succeeds.
// ErrConflict (code volume_attached) while a VM has it attached.
func (c *Client) DeleteVolume(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/volumes/"+url.PathEscape(id), nil, nil, 3*c.timeout)
}

// ResizeVolume grows the volume (online when attached); ErrInvalid for a
// smaller size.
func (c *Client) ResizeVolume(ctx context.Context, id string, sizeMiB int64) (Volume, error) {
	var out Volume
	err := c.do(ctx, http.MethodPost, "/v1/volumes/"+url.PathEscape(id)+"/resize", VolumeResize{SizeMiB: sizeMiB}, &out, 6*c.timeout)
	return out, err
}
