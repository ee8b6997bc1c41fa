package provider

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	dschema "github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// drainPoll is how often an apply that drains a host reads its progress.
const drainPoll = time.Second

var drainStatusAttrTypes = map[string]attr.Type{
	"state":     types.StringType,
	"total":     types.Int64Type,
	"moved":     types.Int64Type,
	"remaining": types.Int64Type,
	"failed":    types.ListType{ElemType: types.StringType},
}

const (
	drainDescription = "Set to `true` to drain the host: it takes no new VM, and the control API migrates every VM " +
		"placed there to other hosts, a few at a time, each to a host its own constraints allow (host labels, group " +
		"caps, networks); a running VM moves live, a stopped one cold. The apply waits until the host is drained and " +
		"fails, naming each VM and why, when some could not move (they keep running here). The VMs keep their ids and " +
		"their `kvm_vm` resources show no change: `host` is computed. Draining the last host that could take VMs is " +
		"refused. Set it back to `false` to put the host in service again. Defaults to `false`."
	drainStatusDescription = "The host's drain: `state` (empty while in service, `draining`, `drained`, or " +
		"`incomplete` when VMs could not move), how many VMs it had when the drain started (`total`), how many left " +
		"since (`moved`), how many are still there (`remaining`), and each VM that could not move with why (`failed`, " +
		"`<vm id>: <reason>`)."
)

func drainStatusResourceAttribute() schema.SingleNestedAttribute {
	return schema.SingleNestedAttribute{
		MarkdownDescription: drainStatusDescription,
		Computed:            true,
		Attributes: map[string]schema.Attribute{
			"state":     schema.StringAttribute{MarkdownDescription: "Drain state.", Computed: true},
			"total":     schema.Int64Attribute{MarkdownDescription: "VMs on the host when the drain started.", Computed: true},
			"moved":     schema.Int64Attribute{MarkdownDescription: "VMs that left the host since.", Computed: true},
			"remaining": schema.Int64Attribute{MarkdownDescription: "VMs still on the host.", Computed: true},
			"failed": schema.ListAttribute{MarkdownDescription: "VMs that could not move: `<vm id>: <reason>`.",
				ElementType: types.StringType, Computed: true},
		},
	}
}

func drainStatusDataAttribute() dschema.SingleNestedAttribute {
	return dschema.SingleNestedAttribute{
		MarkdownDescription: drainStatusDescription,
		Computed:            true,
		Attributes: map[string]dschema.Attribute{
			"state":     dschema.StringAttribute{MarkdownDescription: "Drain state.", Computed: true},
			"total":     dschema.Int64Attribute{MarkdownDescription: "VMs on the host when the drain started.", Computed: true},
			"moved":     dschema.Int64Attribute{MarkdownDescription: "VMs that left the host since.", Computed: true},
			"remaining": dschema.Int64Attribute{MarkdownDescription: "VMs still on the host.", Computed: true},
			"failed": dschema.ListAttribute{MarkdownDescription: "VMs that could not move: `<vm id>: <reason>`.",
				ElementType: types.StringType, Computed: true},
		},
	}
}

func drainStatusValue(d api.HostDrain) types.Object {
	failed := make([]string, 0, len(d.Failed))
	for _, f := range d.Failed {
		failed = append(failed, f.VM+": "+f.Reason)
	}
	return types.ObjectValueMust(drainStatusAttrTypes, map[string]attr.Value{
		"state":     types.StringValue(d.State),
		"total":     types.Int64Value(d.Total),
		"moved":     types.Int64Value(d.Moved),
		"remaining": types.Int64Value(d.Remaining),
		"failed":    stringList(failed),
	})
}

// applyDrain drains or undrains host name to match drain, and for a drain
// waits until it has ended. It returns the host as it is then, and an
// error naming the VMs that could not move when the drain is incomplete.
func applyDrain(ctx context.Context, c *client.Client, name string, drain bool) (api.Host, error) {
	if !drain {
		return c.UndrainHost(ctx, name)
	}
	h, err := c.DrainHost(ctx, name)
	if err != nil {
		return h, err
	}
	tick := time.NewTicker(drainPoll)
	defer tick.Stop()
	for h.Drain.State == api.DrainDraining {
		select {
		case <-ctx.Done():
			return h, fmt.Errorf("host %s is still draining (%d of %d VMs moved) when the apply's time ran out; "+
				"the drain goes on, run terraform apply again to wait for it: %w", name, h.Drain.Moved, h.Drain.Total, ctx.Err())
		case <-tick.C:
		}
		if h, err = c.GetHost(ctx, name); err != nil {
			return h, err
		}
	}
	if h.Drain.State == api.DrainIncomplete {
		var lines []string
		for _, f := range h.Drain.Failed {
			lines = append(lines, fmt.Sprintf("  - VM %s: %s", f.VM, f.Reason))
		}
		return h, fmt.Errorf("host %s drained only in part: %d VMs could not move and keep running there:\n%s\n"+
			"Free capacity or relax their constraints elsewhere, then set drain = false and true again (or apply again)",
			name, len(h.Drain.Failed), strings.Join(lines, "\n"))
	}
	return h, nil
}
