package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// MigrateVM moves VM id to host (empty: the scheduler chooses) and returns
// it once it runs there. It is not retried: a lost answer is told by
// GET /v1/vms/{id} (its host, or its migration while it runs).
func (c *Client) MigrateVM(ctx context.Context, id, host string) (api.VM, error) {
	var out api.VM
	err := c.call(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(id)+"/migrate", api.VMMigrate{Host: host}, &out, "", false)
	return out, err
}

// DrainHost marks host name draining: its VMs are migrated off it (GET the
// host to follow the drain).
func (c *Client) DrainHost(ctx context.Context, name string) (api.Host, error) {
	var out api.Host
	err := c.call(ctx, http.MethodPost, "/v1/hosts/"+url.PathEscape(name)+"/drain", nil, &out, "", true)
	return out, err
}

// UndrainHost puts host name back in service.
func (c *Client) UndrainHost(ctx context.Context, name string) (api.Host, error) {
	var out api.Host
	err := c.call(ctx, http.MethodPost, "/v1/hosts/"+url.PathEscape(name)+"/undrain", nil, &out, "", true)
	return out, err
}
