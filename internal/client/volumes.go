package client

import (
	"context"
	"net/http"
	"net/url"
	"strconv"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// CreateVolume creates a volume; ErrConflict when the name is taken,
// ErrNoCapacity when no host (or not the pinned one) has the disk. It is
// not retried: a create whose answer was lost shows up as a conflict
// naming the existing id.
func (c *Client) CreateVolume(ctx context.Context, in api.VolumeCreate) (api.Volume, error) {
	var out api.Volume
	err := c.call(ctx, http.MethodPost, "/v1/volumes", in, &out, "", false)
	return out, err
}

// GetVolume returns one volume by id or name.
func (c *Client) GetVolume(ctx context.Context, ref string) (api.Volume, error) {
	var out api.Volume
	err := c.call(ctx, http.MethodGet, "/v1/volumes/"+url.PathEscape(ref), nil, &out, "", true)
	return out, err
}

// ListVolumes returns one page of volumes (pageToken "" for the first).
func (c *Client) ListVolumes(ctx context.Context, pageSize int, pageToken string) (api.List[api.Volume], error) {
	q := url.Values{}
	if pageSize > 0 {
		q.Set("page_size", strconv.Itoa(pageSize))
	}
	if pageToken != "" {
		q.Set("page_token", pageToken)
	}
	path := "/v1/volumes"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var out api.List[api.Volume]
	err := c.call(ctx, http.MethodGet, path, nil, &out, "", true)
	return out, err
}

// UpdateVolume grows a volume and/or replaces its labels.
func (c *Client) UpdateVolume(ctx context.Context, ref string, in api.VolumePatch) (api.Volume, error) {
	var out api.Volume
	err := c.call(ctx, http.MethodPatch, "/v1/volumes/"+url.PathEscape(ref), in, &out, "", true)
	return out, err
}

// DeleteVolume deletes a detached volume; ErrConflict (code
// volume_attached) while a VM has it.
func (c *Client) DeleteVolume(ctx context.Context, ref string) error {
	return c.call(ctx, http.MethodDelete, "/v1/volumes/"+url.PathEscape(ref), nil, nil, "", true)
}
