package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// CreateImage registers an image; ErrConflict when the name is taken. It
// is not retried: a lost answer would make the retry a 409.
func (c *Client) CreateImage(ctx context.Context, in api.ImageCreate) (api.Image, error) {
	var out api.Image
	err := c.call(ctx, http.MethodPost, "/v1/images", in, &out, "", false)
	return out, err
}

// GetImage returns one image with its state on each host.
func (c *Client) GetImage(ctx context.Context, name string) (api.Image, error) {
	var out api.Image
	err := c.call(ctx, http.MethodGet, "/v1/images/"+url.PathEscape(name), nil, &out, "", true)
	return out, err
}

// ListImages returns one page of images.
func (c *Client) ListImages(ctx context.Context, opts ListOptions) (api.List[api.Image], error) {
	var out api.List[api.Image]
	err := c.call(ctx, http.MethodGet, "/v1/images"+opts.query(), nil, &out, "", true)
	return out, err
}

// UpdateImage changes min_disk_mib or prefetch in place.
func (c *Client) UpdateImage(ctx context.Context, name string, in api.ImagePatch) (api.Image, error) {
	var out api.Image
	err := c.call(ctx, http.MethodPatch, "/v1/images/"+url.PathEscape(name), in, &out, "", true)
	return out, err
}

// DeleteImage removes an image; ErrConflict (naming the VMs) while VMs use it.
func (c *Client) DeleteImage(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/images/"+url.PathEscape(name), nil, nil, "", true)
}
