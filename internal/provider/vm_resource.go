package provider

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/boolplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/float64planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/mapdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// Default timeouts of kvm_vm operations; the timeouts block overrides them.
const (
	defaultVMCreateTimeout = 10 * time.Minute
	defaultVMUpdateTimeout = 5 * time.Minute
	defaultVMDeleteTimeout = 5 * time.Minute
)

var (
	_ resource.Resource                   = (*vmResource)(nil)
	_ resource.ResourceWithConfigure      = (*vmResource)(nil)
	_ resource.ResourceWithImportState    = (*vmResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*vmResource)(nil)
	_ resource.ResourceWithValidateConfig = (*vmResource)(nil)
)

// NewVMResource is the kvm_vm resource.
func NewVMResource() resource.Resource { return &vmResource{} }

type vmResource struct {
	data *providerData
}

type vmModel struct {
	vmAttributes
	guestModel
	NetworkInterfaces types.List     `tfsdk:"network_interface"`
	VolumeAttachments types.List     `tfsdk:"volume_attachment"`
	Timeouts          timeouts.Value `tfsdk:"timeouts"`
}

// setNICs records the VM's NICs: blocks as configured (withBlocks), or
// none for a VM that only has the implied default NIC. A model whose
// volume_attachment was never set (one built from an API answer alone)
// gets the VM's volumes.
func (m *vmModel) setNICs(vm api.VM, withBlocks bool) {
	m.NetworkInterfaces = nicsValue(vm.NetworkInterfaces, withBlocks)
	if m.VolumeAttachments.ElementType(context.Background()) == nil {
		m.VolumeAttachments = volumeAttachmentsValue(vm.Volumes)
	}
	m.GuestAgent = types.BoolValue(vm.GuestAgent)
}

func (r *vmResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_vm"
}

func (r *vmResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	fixedAtCreate := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A virtual machine on the fleet. The control API places it on the best host (or the pinned " +
			"`host`) that meets its `constraints`, reserves its capacity and boots it. `name`, `vcpus`, `memory_mib`, " +
			"`disk_mib` (grown only), `power_state`, `labels` and `constraints` change in place, keeping the VM's id and disk; " +
			"a change of `vcpus` or `memory_mib` restarts a running guest (a clean power-off, then a boot in the new shape from " +
			"the same disk); a larger `disk_mib` grows the disk without a restart; a change of `constraints` never moves the " +
			"VM; adding or removing a `volume_attachment` block attaches or detaches the volume while the guest runs. " +
			"A change of a pinned `host` migrates the VM there in place (live while it runs, cold while it is stopped), " +
			"keeping its id, disk and addresses; a VM the operator migrated or drained off its host shows no change, since " +
			"`host` is computed. `image` and a change of the configured `network_interface` blocks replace " +
			"the VM, which destroys its own disk; data that must outlive a replace belongs on a `kvm_volume`, attached " +
			"with a `volume_attachment` block (the new VM gets the same volumes, on their host). A refresh reports the power state the host observed, so a VM stopped behind " +
			"Terraform's back shows as a change and `terraform apply` starts it again; a VM deleted behind its back is " +
			"planned for creation.\n\n" +
			"Guest configuration (`user_data` or `user_data_wo`, `ssh_authorized_keys`, `meta_data`, " +
			"`network_config`) goes to the guest on a NoCloud seed disk (volume `cidata`) that its host builds in " +
			"the VM's own directory and attaches read-only; it survives restarts of the VM, its host and the agent. " +
			"Cloud-init reads it at the first boot of each instance, so **changing any of it replaces the VM**, " +
			"and the plan shows the replace. Its `instance-id` is the VM's id: a VM with guest configuration " +
			"boots cold (never from a warm pool, whose VMs booted before their seed existed), and each child of a " +
			"`kvm_fork` is a new instance with its own instance-id and hostname (from the child's name) and the " +
			"parent's user data and keys; a running child keeps the parent's memory (cloud-init has already run in it) and cloud-init " +
			"sees the new instance at the child's next boot, when it runs its per-instance modules again (new SSH " +
			"host keys, for example). `wait_for` makes the create wait for the guest's address or for cloud-init " +
			"to finish, with the serial console's last lines in the error when it does not.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				MarkdownDescription: "ID the control API gave the VM. `terraform import` takes it.",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"name": schema.StringAttribute{
				MarkdownDescription: "Name of the VM, unique in its project. Changed in place: it is the control plane's " +
					"name for the VM, the guest does not see it and keeps running. A name another VM holds fails the apply " +
					"and names that VM. Children of a `kvm_fork` keep their fixed names.",
				Required:   true,
				Validators: []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"project": schema.StringAttribute{
				MarkdownDescription: "Project the VM belongs to, fixed at create: the provider's `project`, or when it " +
					"is left out the token's project (`default` for a fleet-wide token). The VM counts against the " +
					"project's quotas and runs only on hosts with the project's `host_labels`.",
				Computed:      true,
				PlanModifiers: fixedAtCreate,
			},
			"image": schema.StringAttribute{
				MarkdownDescription: "Guest image to boot: a registered image (`kvm_image`, which a host fetches when " +
					"it needs it), or one of the `images` a host offers (for example `busybox`, or `sim` on hosts with " +
					"the simulated driver). Changing it replaces the VM.",
				Required:      true,
				Validators:    []validator.String{stringvalidator.LengthAtLeast(1)},
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
			},
			"secure_boot": schema.BoolAttribute{
				MarkdownDescription: "Boot with UEFI Secure Boot enforced, the Microsoft keys enrolled (OVMF's " +
					"Microsoft-keyed variables, on a q35 machine with SMM): the image must have `firmware = \"uefi\"` " +
					"and a bootloader signed for those keys (shim, as Debian's and Ubuntu's cloud images have); an " +
					"unsigned one is refused by the firmware. Defaults to `false` (a uefi VM boots without Secure " +
					"Boot). Such a VM boots cold, never from a warm pool. Changing it replaces the VM.",
				Optional:      true,
				Computed:      true,
				Default:       booldefault.StaticBool(false),
				PlanModifiers: []planmodifier.Bool{boolplanmodifier.RequiresReplace()},
			},
			"vcpus": schema.Int64Attribute{
				MarkdownDescription: "Number of virtual CPUs. Changed in place: **a running guest restarts** (clean " +
					"power-off, boot with the new count from its own disk); a stopped VM takes it at its next start. " +
					"More vCPUs are reserved on the VM's host first: when that host has no room the apply fails, naming " +
					"the host and what is short, and the VM keeps running unchanged.",
				Required:   true,
				Validators: []validator.Int64{int64validator.AtLeast(1)},
			},
			"memory_mib": schema.Int64Attribute{
				MarkdownDescription: "Memory in MiB. Changed in place: **a running guest restarts** (clean power-off, " +
					"boot with the new size from its own disk, so data on the disk is kept and memory contents are not); " +
					"a stopped VM takes it at its next start. More memory is reserved on the VM's host first: when that " +
					"host has no room the apply fails, naming the host and what is short, and the VM keeps running unchanged.",
				Required:   true,
				Validators: []validator.Int64{int64validator.AtLeast(1)},
			},
			"disk_mib": schema.Int64Attribute{
				MarkdownDescription: "Size of the VM's disk in MiB, its own overlay on the image. A larger value grows " +
					"the disk in place (online while the VM runs, offline while it is stopped; the guest's file system " +
					"is not grown); a smaller one is refused, since disks never shrink.",
				Required:   true,
				Validators: []validator.Int64{int64validator.AtLeast(1)},
			},
			"host": schema.StringAttribute{
				MarkdownDescription: "Name of the host to pin the VM to. Left out, the control API chooses the best host " +
					"and this attribute reports it (also after a migration or a host drain moved the VM: no change is " +
					"planned). Setting it to another host than the VM runs on migrates the VM there in place, keeping its " +
					"id: live while it runs (memory copied while the guest runs, then a short pause), cold while it is " +
					"stopped. The target must take the VM under its own constraints; its read-write volumes move with it " +
					"(a VM with a read-only volume is refused: detach it first).",
				Optional:   true,
				Computed:   true,
				Validators: []validator.String{stringvalidator.LengthAtLeast(1)},
				PlanModifiers: []planmodifier.String{
					stringplanmodifier.UseStateForUnknown(),
				},
			},
			"power_state": schema.StringAttribute{
				MarkdownDescription: "Desired power state: `running` (default) or `stopped`. Changed in place. A refresh " +
					"reports what the host observed, so a VM stopped outside Terraform shows a change back to `running`.",
				Optional:   true,
				Computed:   true,
				Default:    stringdefault.StaticString(api.PowerRunning),
				Validators: []validator.String{stringvalidator.OneOf(api.PowerRunning, api.PowerStopped)},
			},
			"labels": schema.MapAttribute{
				MarkdownDescription: "Labels of the VM (string keys and values). Changed in place.",
				ElementType:         types.StringType,
				Optional:            true,
				Computed:            true,
				Default:             mapdefault.StaticValue(labelsValue(nil)),
			},
			"observed_state": schema.StringAttribute{
				MarkdownDescription: "State the control API last observed on the host: `creating`, `running`, `paused`, " +
					"`stopped`, `error`, `missing`, `lost` (its host was retired) or `unknown` (the host does not answer).",
				Computed: true,
			},
			"started_from": schema.StringAttribute{
				MarkdownDescription: "How the VM was started: `cold` boot, `warm` (from the host's warm pool) or `snapshot`.",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"placement_score": schema.Float64Attribute{
				MarkdownDescription: "Score of the chosen host at placement time (lower is better), to a multiple of 1/1024 " +
					"(about three decimals; `placement_summary` shows five).",
				Computed:      true,
				PlanModifiers: []planmodifier.Float64{float64planmodifier.UseStateForUnknown()},
			},
			"placement_summary": schema.StringAttribute{
				MarkdownDescription: "One line on the placement: the chosen host, its score, and why other hosts were rejected.",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"created_at": schema.StringAttribute{
				MarkdownDescription: "When the VM was created (RFC 3339, UTC).",
				Computed:            true,
				PlanModifiers:       fixedAtCreate,
			},
			"ipv4_address": schema.StringAttribute{
				MarkdownDescription: "Address of the first NIC, known right after apply: assigned by the control plane " +
					"on `nat` networks (and `bridge` networks with a `cidr`); `10.0.2.15` on a user-mode network, where " +
					"the VM is reached through `port_forward`s; null while unknown.",
				Computed:      true,
				PlanModifiers: fixedAtCreate,
			},
			"constraints_violated": schema.StringAttribute{
				MarkdownDescription: "How the VM's host no longer meets its `constraints`, for example `host h1 no longer " +
					"has label rack=a (now rack=b)` after the host's labels changed; empty while they hold. The VM is " +
					"never moved for it: replace it (`terraform apply -replace=kvm_vm.<name>`) to place it again.",
				Computed: true,
			},
		},
		Blocks: map[string]schema.Block{
			"network_interface": networkInterfaceBlock(),
			"volume_attachment": volumeAttachmentBlock(),
			"timeouts":          timeouts.Block(ctx, timeouts.Opts{Create: true, Update: true, Delete: true}),
			"constraints": constraintsResourceBlock("Steers placement: `host_labels` filters hosts, `group` with "+
				"`spread_by` and `max_per_domain` spreads VMs that belong together over failure domains. Changing "+
				"the block never moves a running VM: the plan shows an update in place, the new constraints are "+
				"stored (and read back on import) and `constraints_violated` checks them against the host; they "+
				"decide a placement again only when the VM is replaced, which you ask for with "+
				"`terraform apply -replace=kvm_vm.<name>`.", true),
		},
	}
	maps.Copy(resp.Schema.Attributes, guestResourceAttributes())
}

// ModifyPlan plans user_data_sha256 from the configured user data and
// replaces the VM when it differs from the one in state, and notes a change
// of constraints on an existing VM: it is an update in place that stores
// them, and the VM does not move.
func (r *vmResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() {
		return // destroy
	}
	var want types.String
	// Read from the raw values: this runs for every kvm_vm on every plan.
	userData, err := rawString(req.Config.Raw, "user_data")
	if err == nil {
		var userDataWO types.String
		userDataWO, err = rawString(req.Config.Raw, "user_data_wo")
		want = configuredDigest(userData, userDataWO)
	}
	if err != nil {
		resp.Diagnostics.AddError(summaryPlanVM, fmt.Sprintf("Planning VM: %s. This is a bug in the provider; please report it.", err))
		return
	}
	if req.State.Raw.IsNull() {
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("user_data_sha256"), want)...)
		return // create
	}
	if req.Plan.Raw.Equal(req.State.Raw) {
		// Nothing changes (the usual plan after a refresh): the planned
		// digest is the one in state, so only a configuration whose user
		// data differs from it has anything to plan.
		stateDigest, err := rawString(req.State.Raw, "user_data_sha256")
		if err == nil && want.Equal(stateDigest) {
			return
		}
	}
	var plan, state vmModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	// The control API never returns user data, only its digest: comparing
	// digests catches changed user data (either form) and a VM whose user
	// data differs from the configuration, and leaves alone an imported VM
	// whose user data matches.
	resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("user_data_sha256"), want)...)
	if !want.Equal(state.UserDataSHA256) {
		resp.RequiresReplace = append(resp.RequiresReplace, path.Root("user_data_sha256"))
		return
	}
	if plan.Constraints.Equal(state.Constraints) {
		return
	}
	resp.Diagnostics.AddAttributeWarning(path.Root("constraints"), summaryConstraintsStored, fmt.Sprintf(
		"VM %s (%q) stays on host %s: new constraints are stored and checked (see constraints_violated), but a "+
			"running VM is never moved and keeps its place in its group. To place it again under the new "+
			"constraints, run terraform apply -replace=<address of this kvm_vm>, which destroys its disk.",
		state.ID.ValueString(), state.Name.ValueString(), state.Host.ValueString()))
}

// ValidateConfig refuses waits a stopped VM cannot satisfy.
func (r *vmResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	// Read from the raw config: this runs for every kvm_vm on every plan.
	power, err := rawString(req.Config.Raw, "power_state")
	var waitFor types.String
	if err == nil {
		waitFor, err = rawString(req.Config.Raw, "wait_for")
	}
	if err != nil {
		resp.Diagnostics.AddError(summaryPlanVM, fmt.Sprintf("Validating a kvm_vm configuration: %s. This is a bug in the provider; please report it.", err))
		return
	}
	if waitFor.ValueString() == waitForAgent {
		agentOn, err := rawBool(req.Config.Raw, "guest_agent")
		if err != nil {
			resp.Diagnostics.AddError(summaryPlanVM, fmt.Sprintf("Validating a kvm_vm configuration: %s. This is a bug in the provider; please report it.", err))
			return
		}
		if !agentOn.IsUnknown() && !agentOn.ValueBool() {
			resp.Diagnostics.AddAttributeError(path.Root("wait_for"), summaryInvalidWait,
				"wait_for = \"agent\" waits for the QEMU guest agent, which needs its channel: set guest_agent = true "+
					"(and use an image that runs qemu-guest-agent), or wait for something else.")
		}
	}
	if power.ValueString() != api.PowerStopped {
		return
	}
	if w := waitFor.ValueString(); w == waitForIP || w == waitForCloudInit || w == waitForAgent {
		resp.Diagnostics.AddAttributeError(path.Root("wait_for"), summaryInvalidWait, fmt.Sprintf(
			"wait_for = %q needs a running guest, but power_state is \"stopped\". Use wait_for = \"running\" "+
				"(or leave it out) for a stopped VM.", w))
	}
}

func (r *vmResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (r *vmResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan vmModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultVMCreateTimeout)
	resp.Diagnostics.Append(diags...)
	labels, diags := labelsFromValue(ctx, plan.Labels)
	resp.Diagnostics.Append(diags...)
	nics, diags := nicsOf(ctx, plan.NetworkInterfaces)
	resp.Diagnostics.Append(diags...)
	constraints, diags := constraintsFromObject(ctx, plan.Constraints)
	resp.Diagnostics.Append(diags...)
	volumes, diags := volumesOf(ctx, plan.VolumeAttachments)
	resp.Diagnostics.Append(diags...)
	// The write-only user data is only in the config, never in the plan.
	var userDataWO types.String
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("user_data_wo"), &userDataWO)...)
	if resp.Diagnostics.HasError() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	in := api.VMCreate{
		NetworkInterfaces: nicsToAPI(nics),
		Volumes:           volumes,
		Constraints:       constraints,
		Name:              plan.Name.ValueString(),
		Project:           r.data.project, // "": the token's project
		Image:             plan.Image.ValueString(),
		VCPUs:             plan.VCPUs.ValueInt64(),
		MemoryMiB:         plan.MemoryMiB.ValueInt64(),
		DiskMiB:           plan.DiskMiB.ValueInt64(),
		Host:              plan.Host.ValueString(), // "" when unknown: the control API chooses
		PowerState:        plan.PowerState.ValueString(),
		Labels:            labels,
		SecureBoot:        plan.SecureBoot.ValueBool(),
	}
	resp.Diagnostics.Append(guestCreate(ctx, &in, &plan, userDataWO)...)
	if resp.Diagnostics.HasError() {
		return
	}
	subject := fmt.Sprintf("creating VM %q", in.Name)

	vm, err := r.create(ctx, in)
	if err != nil && client.MayHaveCreated(err) {
		// No definitive answer: the control API may have made the VM (it
		// keeps going after an attempt or this apply's timeout). If it did,
		// keep it in state as tainted, so that nothing runs outside
		// Terraform and the next apply replaces it.
		if found, ok := vmMadeAnyway(ctx, r.data.client, in.Project, in.Name); ok {
			plan.fromAPI(found, desiredPowerState(found))
			resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
			resp.Diagnostics.AddError(summaryVMFailed, fmt.Sprintf(
				"Creating VM %q got no answer in time (%s), but the control API made it: VM %s (state %s). It is kept in "+
					"state as tainted; the next apply replaces it. Raise timeouts.create if creates take this long.",
				in.Name, err, found.ID, found.ObservedState))
			return
		}
	}
	if err != nil {
		if holder := addressHolder(err); holder != "" {
			resp.Diagnostics.AddAttributeError(path.Root("network_interface"), summaryAddressTaken, fmt.Sprintf(
				"VM %q asks for a fixed address that VM %s holds. Choose another ipv4_address, leave it out to get a "+
					"free one, or delete that VM.\n\nError: %s", in.Name, holder, err))
			return
		}
		if errors.Is(err, client.ErrConflict) {
			resp.Diagnostics.AddAttributeError(path.Root("name"), summaryVMNameAlreadyTaken, nameTakenDetail(in.Name, err))
			return
		}
		addCreateInProjectError(&resp.Diagnostics, summaryCreateVM, subject, in.Project, err)
		return
	}
	tflog.Info(ctx, "created VM", map[string]any{"id": vm.ID, "name": vm.Name, "host": vm.Host, "project": vm.Project})

	vm, waitErr := waitForPower(ctx, r.data.client, vm, in.PowerState)
	plan.fromAPI(vm, desiredPowerState(vm))
	plan.setNICs(vm, len(nics) > 0)
	// The VM exists: keep it in state even if it did not come up, so that
	// Terraform marks it tainted and replaces it rather than leaking it.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	if waitErr != nil {
		resp.Diagnostics.AddError(summaryVMFailed, fmt.Sprintf(
			"VM %s (%q) was created but did not become %s: %s. It stays in state as tainted; the next apply replaces "+
				"it. Last lines of its serial console:\n\n%s",
			vm.ID, vm.Name, in.PowerState, waitErr, consoleTail(ctx, r.data.client, vm.ID, consoleTailLines)))
		return
	}
	if r.waitForGuest(ctx, vm, plan.WaitFor.ValueString(), timeout, "timeouts.create", &resp.Diagnostics) {
		r.recordGuestAgentAddresses(ctx, vm.ID, len(nics) > 0, &plan, &resp.State, &resp.Diagnostics)
	}
}

// recordGuestAgentAddresses reads the VM again after a wait for its guest
// agent, so that the addresses it reports are in state right after apply.
// A failed read only logs: the next refresh fills them.
func (r *vmResource) recordGuestAgentAddresses(ctx context.Context, id string, withBlocks bool, m *vmModel, st *tfsdk.State, diags *diag.Diagnostics) {
	if m.WaitFor.ValueString() != waitForAgent {
		return
	}
	vm, err := r.data.client.GetVM(ctx, id)
	if err != nil {
		tflog.Warn(ctx, "reading the guest agent's addresses after the wait", map[string]any{"id": id, "error": err.Error()})
		return
	}
	m.setNICs(vm, withBlocks)
	diags.Append(st.Set(ctx, m)...)
}

// waitForGuest waits, when wait_for asks for more than a running VM, for
// the guest to report it, adding an error with the console's last lines when
// it does not. The VM stays as it is (in state: a failed create taints it).
func (r *vmResource) waitForGuest(ctx context.Context, vm api.VM, waitFor string, timeout time.Duration, timeoutAttr string, diags *diag.Diagnostics) bool {
	if waitFor == "" || waitFor == waitForRunning || vm.PowerState == api.PowerStopped {
		return false
	}
	tflog.Info(ctx, "waiting for the guest", map[string]any{"id": vm.ID, "wait_for": waitFor})
	g, err := waitForGuest(ctx, r.data.client, vm, waitFor)
	if err != nil {
		diags.AddError(summaryGuestNotReady, fmt.Sprintf(
			"VM %s (%q) runs on host %s, but waiting for wait_for = %q failed: %s. The VM stays in state (a "+
				"failed create leaves it tainted, so the next apply replaces it). Check the user data and the "+
				"console below, or raise %s (now %s).\n\nLast %d lines of its serial console:\n\n%s",
			vm.ID, vm.Name, vm.Host, waitFor, err, timeoutAttr, timeout, consoleTailLines,
			consoleTail(ctx, r.data.client, vm.ID, consoleTailLines)))
		return false
	}
	tflog.Info(ctx, "the guest is ready", map[string]any{"id": vm.ID, "wait_for": waitFor, "cloud_init": g.CloudInit,
		"ipv4_addresses": g.IPv4Addresses, "guest_agent": g.GuestAgent})
	return true
}

// create sends one logical create: one Idempotency-Key, which the client
// reuses on each retry of a lost answer, a 5xx or a 409 in_flight. When the
// name is held by a VM the control API marked missing (its host lost it) or
// lost (its host was retired), that
// record is deleted first and the create runs once more under a new key: the
// first attempt has definitely failed.
func (r *vmResource) create(ctx context.Context, in api.VMCreate) (api.VM, error) {
	defer r.data.wrote()
	vm, err := r.data.client.CreateVM(ctx, in, client.NewIdempotencyKey())
	if err == nil || !errors.Is(err, client.ErrConflict) {
		return vm, err
	}
	holder, lookErr := findVMByName(ctx, r.data.client, in.Project, in.Name)
	if lookErr != nil || !api.Gone(holder.ObservedState) {
		return vm, err
	}
	tflog.Info(ctx, "deleting the "+holder.ObservedState+" VM that holds the name", map[string]any{"id": holder.ID, "name": holder.Name})
	if delErr := r.data.client.DeleteVM(ctx, holder.ID); delErr != nil && !errors.Is(delErr, client.ErrNotFound) {
		return vm, errors.Join(err, fmt.Errorf("deleting %s VM %s that holds the name: %w", holder.ObservedState, holder.ID, delErr))
	}
	return r.data.client.CreateVM(ctx, in, client.NewIdempotencyKey())
}

func nameTakenDetail(name string, err error) string {
	if id := conflictingVMID(err); id != "" {
		return fmt.Sprintf("A VM named %q already exists (id %s). Import it with \"terraform import kvm_vm.<name> %s\", "+
			"or choose another name.\n\nError: %s", name, id, id, err)
	}
	return fmt.Sprintf("A VM named %q already exists. Find its id with the kvm_vm data source (name = %q) and import it "+
		"with \"terraform import kvm_vm.<name> <id>\", or choose another name.\n\nError: %s", name, name, err)
}

func (r *vmResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state vmModel
	if dec, err := vmStateDecoder(); err != nil || dec.decode(ctx, req.State.Raw, &state) != nil {
		// Not expected (the decoder follows the schema); the framework's
		// own decoding then says what is wrong.
		state = vmModel{}
		resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
		if resp.Diagnostics.HasError() {
			return
		}
	}
	id := state.ID.ValueString()
	vm, err := r.data.getVM(ctx, id)
	switch {
	case errors.Is(err, client.ErrNotFound):
		tflog.Info(ctx, "VM is gone from the control API; removing it from state", map[string]any{"id": id})
		resp.State.RemoveResource(ctx)
		return
	case err != nil:
		addAPIError(&resp.Diagnostics, summaryReadVM, fmt.Sprintf("reading VM %s", id), err)
		return
	case api.Gone(vm.ObservedState):
		tflog.Info(ctx, "VM is "+vm.ObservedState+" with its host; removing it from state", map[string]any{"id": id, "host": vm.Host, "reason": vm.Reason})
		resp.State.RemoveResource(ctx)
		return
	}
	if vm.GuestAgent && vm.ObservedState == api.StateRunning {
		// A list leaves out what the guest agent reports (one guest round
		// trip per VM): read this VM on its own for it.
		if full, err := r.data.client.GetVM(ctx, id); err == nil {
			vm = full
		} else {
			tflog.Warn(ctx, "reading the guest agent's addresses; they stay as they were", map[string]any{"id": id, "error": err.Error()})
		}
	}
	prior := state
	state.fromAPI(vm, observedPowerState(vm))
	state.setNICs(vm, hasBlocks(state.NetworkInterfaces))
	vols, diags := readVolumeAttachments(ctx, state.VolumeAttachments, vm, apiVolumeIDs(r.data.client))
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	state.VolumeAttachments = vols
	if state.WaitFor.IsNull() {
		state.WaitFor = types.StringValue(waitForRunning) // an import: the default
	}
	// The framework hands over an empty list of blocks as null (and
	// Terraform takes either for none): no network_interface blocks in state
	// and none read back is no change.
	cmp := state
	if prior.NetworkInterfaces.IsNull() && !cmp.NetworkInterfaces.IsUnknown() && len(cmp.NetworkInterfaces.Elements()) == 0 {
		cmp.NetworkInterfaces = prior.NetworkInterfaces
	}
	if sameAttributes(prior, cmp) {
		// The usual refresh: nothing changed, and resp.State already holds
		// the prior state; encoding it again would cost more than the rest
		// of the Read.
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *vmResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state vmModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, defaultVMUpdateTimeout)
	resp.Diagnostics.Append(diags...)
	labels, diags := labelsFromValue(ctx, plan.Labels)
	resp.Diagnostics.Append(diags...)
	constraints, diags := constraintsFromObject(ctx, plan.Constraints)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	if constraints == nil {
		constraints = &api.Constraints{} // clears them
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	id := state.ID.ValueString()
	if host := plan.Host.ValueString(); host != "" && !plan.Host.IsUnknown() && host != state.Host.ValueString() {
		tflog.Info(ctx, "migrating VM to its pinned host", map[string]any{"id": id, "from": state.Host.ValueString(), "to": host})
		_, err := r.data.client.MigrateVM(ctx, id, host)
		r.data.wrote()
		if err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("host"), summaryUpdateVM, fmt.Sprintf("VM %s (%q) could not migrate "+
				"from host %s to host %s; it keeps running on %s. Choose another host or free capacity there, then run "+
				"terraform apply again.\n\nError: %s", id, state.Name.ValueString(), state.Host.ValueString(), host,
				state.Host.ValueString(), err))
			return
		}
	}
	// Send the whole in-place desired state: PATCH is idempotent, and the
	// stored power_state may be the observed one, not what the API holds.
	power := plan.PowerState.ValueString()
	name, vcpus, memory := plan.Name.ValueString(), plan.VCPUs.ValueInt64(), plan.MemoryMiB.ValueInt64()
	// Constraints are stored, never acted on: the VM stays on its host.
	patch := api.VMPatch{PowerState: &power, Labels: &labels, Name: &name, VCPUs: &vcpus, MemoryMiB: &memory,
		Constraints: constraints}
	if disk := plan.DiskMiB.ValueInt64(); disk != state.DiskMiB.ValueInt64() {
		patch.DiskMiB = &disk
		tflog.Info(ctx, "growing the VM's disk in place", map[string]any{"id": id, "disk_mib": disk})
	}
	if vcpus != state.VCPUs.ValueInt64() || memory != state.MemoryMiB.ValueInt64() {
		tflog.Info(ctx, "resizing VM in place; a running guest restarts", map[string]any{"id": id,
			"vcpus": vcpus, "memory_mib": memory})
	}
	vm, err := r.data.client.UpdateVM(ctx, id, patch)
	r.data.wrote()
	if err != nil {
		if errors.Is(err, client.ErrConflict) && name != state.Name.ValueString() && conflictingVMID(err) != "" {
			resp.Diagnostics.AddAttributeError(path.Root("name"), summaryVMNameAlreadyTaken, nameTakenDetail(name, err))
			return
		}
		if errors.Is(err, client.ErrNoCapacity) && plan.DiskMiB.ValueInt64() > state.DiskMiB.ValueInt64() &&
			vcpus == state.VCPUs.ValueInt64() && memory == state.MemoryMiB.ValueInt64() {
			resp.Diagnostics.AddError(summaryUpdateVM, fmt.Sprintf("VM %s (%q) cannot grow its disk to %d MiB: its host "+
				"%s has no room for the difference. Nothing was changed. Ask for less, or free disk on that host, then "+
				"run terraform apply again.\n\nError: %s",
				id, state.Name.ValueString(), plan.DiskMiB.ValueInt64(), state.Host.ValueString(), err))
			return
		}
		if errors.Is(err, client.ErrNoCapacity) {
			resp.Diagnostics.AddError(summaryUpdateVM, fmt.Sprintf("VM %s (%q) cannot grow to %d vCPUs and %d MiB: its host "+
				"%s has no room for the difference. The VM keeps running in its current shape. Ask for less, or free "+
				"capacity on that host, then run terraform apply again.\n\nError: %s",
				id, state.Name.ValueString(), vcpus, memory, state.Host.ValueString(), err))
			return
		}
		addAPIError(&resp.Diagnostics, summaryUpdateVM, fmt.Sprintf("updating VM %s (%q)", id, state.Name.ValueString()), err)
		return
	}
	vm = r.updateVolumeAttachments(ctx, vm, state.VolumeAttachments, plan.VolumeAttachments, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	vm, err = waitForPower(ctx, r.data.client, vm, power)
	if err != nil {
		resp.Diagnostics.AddError(summaryVMFailed, fmt.Sprintf(
			"VM %s (%q) did not become %s: %s. Check the host, then run terraform apply again.", id, vm.Name, power, err))
		return
	}
	plan.fromAPI(vm, desiredPowerState(vm))
	plan.setNICs(vm, hasBlocks(plan.NetworkInterfaces))
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	if r.waitForGuest(ctx, vm, plan.WaitFor.ValueString(), timeout, "timeouts.update", &resp.Diagnostics) {
		r.recordGuestAgentAddresses(ctx, vm.ID, hasBlocks(plan.NetworkInterfaces), &plan, &resp.State, &resp.Diagnostics)
	}
}

func (r *vmResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state vmModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultVMDeleteTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	id := state.ID.ValueString()
	subject := fmt.Sprintf("deleting VM %s (%q)", id, state.Name.ValueString())
	err := r.data.client.DeleteVM(ctx, id)
	r.data.wrote()
	if err != nil && !errors.Is(err, client.ErrNotFound) {
		addAPIError(&resp.Diagnostics, summaryDeleteVM, subject, err)
		return
	}
	if err := waitForGone(ctx, r.data.client, id); err != nil {
		addAPIError(&resp.Diagnostics, summaryDeleteVM, subject, err)
	}
}

func (r *vmResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	if req.ID == "" {
		resp.Diagnostics.AddError(summaryImportVM, "Import a VM by its id: terraform import kvm_vm.<name> <id>.")
		return
	}
	resource.ImportStatePassthroughID(ctx, path.Root("id"), req, resp)
}

// findVMByName returns the VM named name in project, or ErrNotFound.
// Names are unique per project; project "" is where the token's creates go
// (its own project, default for a fleet-wide token: GET /v1/whoami), so a
// fleet-wide token never takes another project's VM of the same name for
// one of its own (a create's cleanup deletes what this returns).
func findVMByName(ctx context.Context, c *client.Client, project, name string) (api.VM, error) {
	if project == "" {
		who, err := c.WhoAmI(ctx)
		if err != nil {
			return api.VM{}, err
		}
		project = who.CreateProject
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{Name: name})
	if err != nil {
		return api.VM{}, err
	}
	for _, vm := range vms {
		if vm.Name == name && vm.Project == project {
			return vm, nil
		}
	}
	return api.VM{}, fmt.Errorf("no VM named %q in project %s: %w", name, project, client.ErrNotFound)
}

// vmMadeAnyway looks up, after a create that got no definitive answer, the
// VM the control API may have made under this name (with a fresh deadline:
// the create's may be spent).
func vmMadeAnyway(ctx context.Context, c *client.Client, project, name string) (api.VM, bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	vm, err := findVMByName(ctx, c, project, name)
	if err != nil {
		tflog.Warn(ctx, "looking up a VM whose create got no answer", map[string]any{"name": name, "error": err.Error()})
		return api.VM{}, false
	}
	return vm, true
}
