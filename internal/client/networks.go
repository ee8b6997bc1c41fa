package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// CreateNetwork creates a network; ErrConflict when the name is taken or
// its cidr overlaps another network's. It is not retried: a create whose
// answer was lost shows up as a conflict on the retry.
func (c *Client) CreateNetwork(ctx context.Context, in api.NetworkCreate) (api.Network, error) {
	var out api.Network
	err := c.call(ctx, http.MethodPost, "/v1/networks", in, &out, "", false)
	return out, err
}

// GetNetwork returns one network.
func (c *Client) GetNetwork(ctx context.Context, name string) (api.Network, error) {
	var out api.Network
	err := c.call(ctx, http.MethodGet, "/v1/networks/"+url.PathEscape(name), nil, &out, "", true)
	return out, err
}

// ListNetworks returns every network.
func (c *Client) ListNetworks(ctx context.Context) ([]api.Network, error) {
	var out api.List[api.Network]
	err := c.call(ctx, http.MethodGet, "/v1/networks", nil, &out, "", true)
	return out.Items, err
}

// UpdateNetwork changes a network in place (its hosts).
func (c *Client) UpdateNetwork(ctx context.Context, name string, in api.NetworkPatch) (api.Network, error) {
	var out api.Network
	err := c.call(ctx, http.MethodPatch, "/v1/networks/"+url.PathEscape(name), in, &out, "", true)
	return out, err
}

// DeleteNetwork deletes a network; ErrConflict while VMs use it.
func (c *Client) DeleteNetwork(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/networks/"+url.PathEscape(name), nil, nil, "", true)
}
