package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// MoveVolume moves a detached volume to another host and returns it on
// its new host (the same host: unchanged). It is not retried: a move
// whose answer was lost is still running or done; read the volume (state
// moving until it ends) to tell.
func (c *Client) MoveVolume(ctx context.Context, ref, host string) (api.Volume, error) {
	var out api.Volume
	err := c.call(ctx, http.MethodPost, "/v1/volumes/"+url.PathEscape(ref)+"/move", api.VolumeMove{Host: host}, &out, "", false)
	return out, err
}
