package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// moveVolume moves the volume of state to host to (POST
// /v1/volumes/{id}/move), which keeps its id and data. When no answer
// comes (a timeout, a cut connection) the move may still run: the volume
// is read until it is no longer moving, and it must then be on to. It
// reports whether the volume is on to.
func (r *volumeResource) moveVolume(ctx context.Context, state volumeModel, to string, diags *diag.Diagnostics) bool {
	id, name, from := state.ID.ValueString(), state.Name.ValueString(), state.Host.ValueString()
	tflog.Info(ctx, "moving volume", map[string]any{"id": id, "name": name, "from": from, "to": to})
	v, err := r.data.client.MoveVolume(ctx, id, to)
	r.data.wrote()
	var ce *client.Error
	answered := errors.As(err, &ce) && ce.Code != "" // the control API's own error envelope
	if err != nil && client.MayHaveCreated(err) && !answered {
		// No answer from the control API (a timeout, a cut connection): the
		// move may run on; its outcome is where the volume ends up.
		tflog.Warn(ctx, "no answer to the volume move; reading the volume until it is no longer moving", map[string]any{"id": id, "err": err.Error()})
		v, err = waitForMove(ctx, r.data.client, id)
	}
	switch {
	case err == nil && v.Host == to:
		tflog.Info(ctx, "moved volume", map[string]any{"id": id, "host": v.Host, "state": v.State})
		return true
	case err == nil:
		reason := v.Reason
		if reason == "" {
			reason = "the move failed and was undone; its error is in the control API's log"
		}
		diags.AddAttributeError(path.Root("host"), summaryMoveVolume, fmt.Sprintf(
			"Volume %q (%s) is on host %s (state %s) after its move to host %s: %s. Its data is where it was; run terraform apply again to retry the move.",
			name, id, v.Host, v.State, to, reason))
	case errors.As(err, &ce) && ce.Code == api.CodeVolumeAttached:
		diags.AddAttributeError(path.Root("host"), summaryVolumeMoveAttached, fmt.Sprintf(
			"Volume %q (%s) cannot move from host %s to host %s while a VM has it attached: only a detached volume moves. "+
				"Remove the volume_attachment block from that VM (or destroy the VM) and apply, then change host and apply again.\n\nError: %s",
			name, id, from, to, err))
	default:
		addAPIError(diags, summaryMoveVolume, fmt.Sprintf("moving volume %q (%s) from host %s to host %s", name, id, from, to), err)
	}
	return false
}

// waitForMove reads volume id until it is no longer moving.
func waitForMove(ctx context.Context, c *client.Client, id string) (api.Volume, error) {
	return stateChange[api.Volume]{
		Pending: []string{api.VolumeMoving},
		Target:  []string{api.VolumeReady},
		Refresh: func(ctx context.Context) (api.Volume, string, error) {
			v, err := c.GetVolume(ctx, id)
			if err != nil {
				return v, "", fmt.Errorf("reading volume %s: %w", id, err)
			}
			return v, v.State, nil
		},
		Unexpected: func(v api.Volume, state string) error {
			return fmt.Errorf("volume %s is %s on host %s (%s)", id, state, v.Host, v.Reason)
		},
		TimedOut: func(v api.Volume, state string, err error) error {
			return fmt.Errorf("volume %s is still %s (on host %s: %s) when the timeout ended; read it later: %w", id, state, v.Host, v.Reason, err)
		},
	}.wait(ctx)
}
