package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// AttachVolume attaches a volume (name or id) to a VM, hot when it runs,
// and returns the VM. Attaching it again with the same read_only changes
// nothing, so the call is retried. ErrConflict (code volume_attached)
// when another VM has it read-write, ErrInvalid when it is on another
// host or the VM has the most volumes it can have, ErrNotFound for an
// unknown VM or volume.
func (c *Client) AttachVolume(ctx context.Context, vmID string, in api.VMVolumeAttach) (api.VM, error) {
	var out api.VM
	err := c.call(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(vmID)+"/volumes", in, &out, "", true)
	return out, err
}

// DetachVolume detaches a volume (name or id) from a VM, hot when it
// runs; a volume that is not attached to it is no error.
func (c *Client) DetachVolume(ctx context.Context, vmID, volume string) error {
	return c.call(ctx, http.MethodDelete, "/v1/vms/"+url.PathEscape(vmID)+"/volumes/"+url.PathEscape(volume), nil, nil, "", true)
}
