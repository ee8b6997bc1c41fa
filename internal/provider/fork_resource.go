package provider

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// Default timeouts of kvm_fork operations; the timeouts block overrides them.
const (
	defaultForkCreateTimeout = 10 * time.Minute
	defaultForkUpdateTimeout = 10 * time.Minute
	defaultForkDeleteTimeout = 5 * time.Minute
)

var (
	_ resource.Resource                = (*forkResource)(nil)
	_ resource.ResourceWithConfigure   = (*forkResource)(nil)
	_ resource.ResourceWithImportState = (*forkResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*forkResource)(nil)
)

// NewForkResource is the kvm_fork resource.
func NewForkResource() resource.Resource { return &forkResource{} }

type forkResource struct {
	data *providerData
}

// forkAttributes are the attributes kvm_fork (resource and data source) share.
// The number of children is child_count: "count" is a Terraform meta-argument
// and cannot be an attribute name.
type forkAttributes struct {
	ID          types.String `tfsdk:"id"`
	SourceVMID  types.String `tfsdk:"source_vm_id"`
	ChildCount  types.Int64  `tfsdk:"child_count"`
	PauseSource types.Bool   `tfsdk:"pause_source"`
	Placement   types.String `tfsdk:"placement"`
	SnapshotID  types.String `tfsdk:"snapshot_id"`
	Phase       types.String `tfsdk:"phase"`
	Children    types.List   `tfsdk:"children"`
	CreatedAt   types.String `tfsdk:"created_at"`
	Constraints types.Object `tfsdk:"constraints"`
}

type forkModel struct {
	forkAttributes
	Timeouts timeouts.Value `tfsdk:"timeouts"`
}

// forkChildAttrTypes is the object type of one element of children.
var forkChildAttrTypes = map[string]attr.Type{
	"id":             types.StringType,
	"name":           types.StringType,
	"project":        types.StringType,
	"host":           types.StringType,
	"observed_state": types.StringType,
	"ipv4_address":   types.StringType,
	// guest_ipv4_address is the first NIC's GuestIPv4Address.
	"guest_ipv4_address": types.StringType,
	"volume_ids":         types.ListType{ElemType: types.StringType},
}

// fromAPI fills the attributes from a fork as the control API reports it.
func (m *forkAttributes) fromAPI(f api.Fork) {
	m.ID = types.StringValue(f.ID)
	m.SourceVMID = types.StringValue(f.SourceVMID)
	m.ChildCount = types.Int64Value(int64(f.Count))
	m.PauseSource = types.BoolValue(f.PauseSource)
	m.Placement = types.StringValue(f.Placement)
	if f.Placement == "" {
		m.Placement = types.StringValue(api.PlacementColocate) // the control API's default
	}
	m.SnapshotID = optionalString(f.SnapshotID)
	m.Phase = types.StringValue(f.Phase)
	m.Children = forkChildren(f.Children)
	m.CreatedAt = timestamp(f.CreatedAt)
	m.Constraints = constraintsObject(f.Constraints, m.Constraints)
}

// forkChildren lists the children in slot order (child i is named
// "<fork>-<i>"), so the list does not depend on the order the API answers in.
func forkChildren(children []api.VM) types.List {
	sorted := append([]api.VM(nil), children...)
	sort.SliceStable(sorted, func(i, j int) bool {
		si, sj := childSlot(sorted[i].Name), childSlot(sorted[j].Name)
		if si != sj {
			return si < sj
		}
		return sorted[i].Name < sorted[j].Name
	})
	elems := make([]attr.Value, len(sorted))
	for i, vm := range sorted {
		vols := []attr.Value{}
		for _, v := range vm.Volumes {
			vols = append(vols, types.StringValue(v.VolumeID))
		}
		elems[i] = types.ObjectValueMust(forkChildAttrTypes, map[string]attr.Value{
			"volume_ids":         types.ListValueMust(types.StringType, vols),
			"id":                 types.StringValue(vm.ID),
			"name":               types.StringValue(vm.Name),
			"project":            optionalString(vm.Project),
			"host":               optionalString(vm.Host),
			"observed_state":     optionalString(vm.ObservedState),
			"ipv4_address":       optionalString(vm.IPv4Address),
			"guest_ipv4_address": optionalString(firstGuestAddress(vm)),
		})
	}
	return types.ListValueMust(types.ObjectType{AttrTypes: forkChildAttrTypes}, elems)
}

// firstGuestAddress is the address a child's guest has inside on its first
// NIC when that is on a nat network (the source's), or "".
func firstGuestAddress(vm api.VM) string {
	if len(vm.NetworkInterfaces) == 0 {
		return ""
	}
	return vm.NetworkInterfaces[0].GuestIPv4Address
}

// childSlot is the slot number at the end of a child's name, or -1.
func childSlot(name string) int {
	i := strings.LastIndexByte(name, '-')
	if i < 0 {
		return -1
	}
	n, err := strconv.Atoi(name[i+1:])
	if err != nil {
		return -1
	}
	return n
}

func (r *forkResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_fork"
}

func (r *forkResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	fixedAtCreate := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Forks a running VM into `child_count` children. The control API snapshots the source once " +
			"(memory and a frozen disk point), then starts every child from that snapshot: each child resumes exactly " +
			"where the source was, with its own disk overlay and a new identity (MAC, vmgenid). `child_count` changes in " +
			"place: more children start from the same snapshot, fewer remove the highest slots. `source_vm_id` and " +
			"`placement` replace the fork (a new snapshot and new children). Destroying the fork deletes its children " +
			"and its snapshot on every host.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "ID the control API gave the fork. `terraform import` takes it.",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"source_vm_id": schema.StringAttribute{
				MarkdownDescription: "ID of the running VM to fork (for example `kvm_vm.x.id`). Changing it replaces the fork.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
				PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"child_count": schema.Int64Attribute{
				MarkdownDescription: "Number of children, at least 1. Changed in place: a larger number starts more " +
					"children from the same snapshot, a smaller one deletes the children of the highest slots. (Named " +
					"`child_count` because `count` is a Terraform meta-argument.)",
				Required:   true,
				Validators: []validator.Int64{int64validator.AtLeast(1)},
			},
			"pause_source": schema.BoolAttribute{
				MarkdownDescription: "Leave the source VM paused after the snapshot instead of resuming it. Defaults to " +
					"`false`. It acts only when the fork point is taken, which happens once, at create. Changing it later " +
					"is an in-place update that records the new value and nothing else: it does not pause or resume the " +
					"source and does not take a new snapshot, since that would replace every child (the plan warns). To " +
					"fork again with the new value, replace the fork (`terraform apply -replace`).",
				Optional: true,
				Computed: true,
				Default:  booldefault.StaticBool(false),
			},
			"placement": schema.StringAttribute{
				MarkdownDescription: "Where the children go: `colocate` (default) fills the source's host first and " +
					"spills the rest to other hosts, which pull the snapshot from the source's host; `spread` places each " +
					"child like a new VM. Changing it replaces the fork.",
				Optional:      true,
				Computed:      true,
				Default:       stringdefault.StaticString(api.PlacementColocate),
				Validators:    []validator.String{stringvalidator.OneOf(api.PlacementColocate, api.PlacementSpread)},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"snapshot_id": schema.StringAttribute{
				MarkdownDescription: "ID of the one snapshot every child starts from (the fork point).",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"phase": schema.StringAttribute{
				MarkdownDescription: "Phase of the fork's last pass: `pending`, `snapshotting`, `spawning`, `ready`, `retrying` (the pass " +
					"failed; the control API runs it again a few times by itself) or `failed` (it failed that many times " +
					"in a row and is not retried by itself). When it is not `ready`, the plan shows an update that resumes the pass (apply sends " +
					"`child_count` again and waits until the fork is ready).",
				Computed: true,
			},
			"children": schema.ListNestedAttribute{
				MarkdownDescription: "The children, in slot order (child `i` is named `<fork id>-<i>`).",
				Computed:            true,
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"id":   schema.StringAttribute{MarkdownDescription: "ID of the child VM.", Computed: true},
					"name": schema.StringAttribute{MarkdownDescription: "Name of the child VM, `<fork id>-<slot>`.", Computed: true},
					"project": schema.StringAttribute{
						MarkdownDescription: "Project of the child: its source VM's. Children count against its quotas.",
						Computed:            true,
					},
					"host": schema.StringAttribute{MarkdownDescription: "Host the child runs on.", Computed: true},
					"ipv4_address": schema.StringAttribute{
						MarkdownDescription: "Address of the child's first NIC: its own, allocated with its reservation " +
							"(children never share the source's address).",
						Computed: true,
					},
					"guest_ipv4_address": schema.StringAttribute{
						MarkdownDescription: "On a `nat` network, the address the child's guest has inside on its first " +
							"NIC: the source's address at the fork point, which the host translates to and from " +
							"`ipv4_address`. Inside the child it names the child itself, so the child cannot reach its " +
							"source there (see the networks guide). Null on other networks.",
						Computed: true,
					},
					"observed_state": schema.StringAttribute{
						MarkdownDescription: "State the control API last observed on the child's host (see `kvm_vm`).",
						Computed:            true,
					},
					"volume_ids": schema.ListAttribute{
						MarkdownDescription: "IDs of the child's volumes, in its source's order: for each read-write " +
							"volume of the source, a copy-on-write clone of it as it was at the fork, named " +
							"`<volume name>-<child name>` (a volume of its own that outlives the child); for each " +
							"read-only volume, the source's volume itself, shared. See the Volumes guide.",
						ElementType: types.StringType,
						Computed:    true,
					},
				}},
			},
			"created_at": schema.StringAttribute{
				MarkdownDescription: "When the fork was created (RFC 3339, UTC).",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
		},
		Blocks: map[string]schema.Block{
			"timeouts": timeouts.Block(ctx, timeouts.Opts{Create: true, Update: true, Delete: true}),
			"constraints": constraintsResourceBlock("Steers the placement of every child, as on `kvm_vm`. Without "+
				"`group`, the children form a group of their own, so `spread_by = \"host\"` with `max_per_domain = 1` "+
				"puts each child on its own host. With `placement = \"colocate\"` the source's host is tried first "+
				"and the constraints still hold there. Changing the block is an update in place: children placed from "+
				"then on (a larger `child_count`, a resumed pass) follow it; running children never move.", false),
		},
	}
}

func (r *forkResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan does two things for an existing fork. A fork whose last pass
// did not end ready (it failed, or a crash cut it short) is planned for an
// update, with phase unknown, so that apply sends its count again, which
// resumes the pass. And a change of pause_source draws a warning: the value
// is recorded, but the fork point it governed is already taken.
func (r *forkResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.State.Raw.IsNull() || req.Plan.Raw.IsNull() {
		return // create or destroy
	}
	var plan, state forkModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	replaced := !plan.SourceVMID.Equal(state.SourceVMID) || !plan.Placement.Equal(state.Placement)
	if replaced {
		return // a new fork: its pass and its pause_source start afresh
	}
	if phase := state.Phase.ValueString(); phase != "" && phase != api.ForkReady {
		tflog.Info(ctx, "fork's last pass did not end ready; planning an update that resumes it",
			map[string]any{"id": state.ID.ValueString(), "phase": phase})
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("phase"), types.StringUnknown())...)
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("children"),
			types.ListUnknown(types.ObjectType{AttrTypes: forkChildAttrTypes}))...)
	}
	if plan.PauseSource.IsUnknown() || state.PauseSource.IsNull() || plan.PauseSource.Equal(state.PauseSource) {
		return
	}
	resp.Diagnostics.AddAttributeWarning(path.Root("pause_source"), summaryForkPointTaken, fmt.Sprintf(
		"Fork %s took its snapshot with pause_source = %t. Changing it to %t records the new value only: it neither "+
			"pauses nor resumes source VM %s, and its children keep the snapshot they started from. To fork again with "+
			"the new value, run terraform apply -replace on this fork.",
		state.ID.ValueString(), state.PauseSource.ValueBool(), plan.PauseSource.ValueBool(), state.SourceVMID.ValueString()))
}

func (r *forkResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan forkModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultForkCreateTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	in := api.ForkCreate{
		SourceVMID:  plan.SourceVMID.ValueString(),
		Count:       int(plan.ChildCount.ValueInt64()),
		PauseSource: plan.PauseSource.ValueBool(),
		Placement:   plan.Placement.ValueString(),
	}
	in.Constraints, diags = constraintsFromObject(ctx, plan.Constraints)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	subject := fmt.Sprintf("forking VM %s into %d children", in.SourceVMID, in.Count)

	// One logical create: one Idempotency-Key, which the client reuses on
	// each retry of a lost answer, a 5xx or a 409 in_flight, so a retry
	// never takes a second snapshot or makes a second set of children.
	f, err := r.data.client.CreateFork(ctx, in, client.NewIdempotencyKey())
	r.data.wrote()
	var waitErr error
	switch id := failedForkID(err); {
	case err == nil:
		tflog.Info(ctx, "created fork", map[string]any{"id": f.ID, "source_vm_id": f.SourceVMID, "count": f.Count, "phase": f.Phase})
		f, waitErr = waitForFork(ctx, r.data.client, f)
		r.data.wrote()
	case id != "":
		// The fork exists but its pass failed: the control API keeps it
		// (children and snapshot included) until it is deleted.
		tflog.Info(ctx, "fork was created but its pass failed", map[string]any{"id": id, "error": err.Error()})
		waitErr = err
		var readErr error
		if f, readErr = r.data.client.GetFork(ctx, id); readErr != nil {
			// Still keep its id in state, so that the next apply deletes it.
			waitErr = fmt.Errorf("%w; reading the fork afterwards failed too: %w", waitErr, readErr)
			f = api.Fork{ID: id, SourceVMID: in.SourceVMID, PauseSource: in.PauseSource, Placement: in.Placement, Phase: api.ForkFailed}
		}
	case errors.Is(err, client.ErrNotFound), errors.Is(err, client.ErrConflict):
		// The source VM is gone or not running: a configuration matter.
		resp.Diagnostics.AddAttributeError(path.Root("source_vm_id"), summaryCreateFork, apiErrorDetail(subject, err))
		return
	default:
		addAPIError(&resp.Diagnostics, summaryCreateFork, subject, err)
		return
	}
	plan.fromAPI(f)
	// The fork exists: keep it in state even if it did not become ready, so
	// that Terraform marks it tainted and replaces it rather than leaking its
	// children and snapshot.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	if waitErr != nil {
		resp.Diagnostics.AddError(summaryForkFailed, fmt.Sprintf(
			"Fork %s of VM %s was created but did not become ready: %s. It stays in state as tainted; the next apply "+
				"deletes it (its children and its snapshot) and forks again. If that fails too, check that the source "+
				"VM is running and that the hosts have room for %d children (data source kvm_hosts).%s",
			f.ID, in.SourceVMID, waitErr, in.Count, rejectionLines(waitErr)))
	}
}

func (r *forkResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state forkModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	id := state.ID.ValueString()
	f, err := r.data.client.GetFork(ctx, id)
	switch {
	case errors.Is(err, client.ErrNotFound):
		tflog.Info(ctx, "fork is gone from the control API; removing it from state", map[string]any{"id": id})
		resp.State.RemoveResource(ctx)
		return
	case err != nil:
		addAPIError(&resp.Diagnostics, summaryReadFork, fmt.Sprintf("reading fork %s", id), err)
		return
	}
	// pause_source is the recorded setting (see its description): the API
	// keeps the value the snapshot was taken with. An import has none yet.
	recorded := state.PauseSource
	state.fromAPI(f)
	if !recorded.IsNull() && !recorded.IsUnknown() {
		state.PauseSource = recorded
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *forkResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state forkModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, defaultForkUpdateTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	constraints, diags := constraintsFromObject(ctx, plan.Constraints)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	if constraints == nil {
		constraints = &api.Constraints{} // clears them
	}
	id := state.ID.ValueString()
	count := int(plan.ChildCount.ValueInt64())
	// Send the count even when only pause_source changed: PATCH is
	// idempotent, and it resumes a pass that did not finish.
	f, err := r.data.client.UpdateFork(ctx, id, api.ForkPatch{Count: &count, Constraints: constraints})
	r.data.wrote()
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryUpdateFork, fmt.Sprintf("changing fork %s to %d children", id, count), err)
		return
	}
	f, err = waitForFork(ctx, r.data.client, f)
	r.data.wrote()
	if err != nil {
		// The prior state stays; the next refresh finds the fork not ready,
		// and the plan resumes it (ModifyPlan).
		resp.Diagnostics.AddError(summaryForkFailed, fmt.Sprintf(
			"Fork %s did not become ready with %d children: %s. Run terraform apply again to resume it; if it fails "+
				"again, check that the hosts have room for the children (data source kvm_hosts).", id, count, err))
		return
	}
	pause := plan.PauseSource
	plan.fromAPI(f)
	plan.PauseSource = pause
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *forkResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state forkModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultForkDeleteTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	id := state.ID.ValueString()
	subject := fmt.Sprintf("deleting fork %s (its children and its snapshot)", id)
	err := r.data.client.DeleteFork(ctx, id)
	r.data.wrote()
	if err != nil && !errors.Is(err, client.ErrNotFound) {
		addAPIError(&resp.Diagnostics, summaryDeleteFork, subject, err)
		return
	}
	if err := waitForForkGone(ctx, r.data.client, id); err != nil {
		addAPIError(&resp.Diagnostics, summaryDeleteFork, subject, err)
	}
}

func (r *forkResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	if req.ID == "" {
		resp.Diagnostics.AddError(summaryImportFork, "Import a fork by its id: terraform import kvm_fork.<name> <id>.")
		return
	}
	resource.ImportStatePassthroughID(ctx, path.Root("id"), req, resp)
}

// failedForkID is the id of the fork a failed create or update still left in
// place, when the control API names it in the error's details.
func failedForkID(err error) string {
	var ae *client.Error
	if !errors.As(err, &ae) {
		return ""
	}
	id, _ := ae.Details["fork_id"].(string)
	return id
}
