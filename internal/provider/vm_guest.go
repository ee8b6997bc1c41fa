package provider

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/boolplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/listplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/mapplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// What kvm_vm's wait_for can wait for after the VM runs.
const (
	waitForRunning   = "running"
	waitForIP        = "ip"
	waitForCloudInit = "cloud_init"
	waitForAgent     = "agent"
)

// consoleTailLines is how much of the serial console a failed wait shows.
const (
	consoleTailLines = 30
	consoleTailBytes = 16 << 10
)

// guestModel is kvm_vm's guest configuration as the resource alone has it:
// the user data (kept, sensitive, or write-only and never kept) and what to
// wait for. The rest (keys, meta-data, network config, hostname, digest) is
// in vmAttributes, which the data source shares.
type guestModel struct {
	UserData          types.String `tfsdk:"user_data"`
	UserDataWO        types.String `tfsdk:"user_data_wo"`
	UserDataWOVersion types.Int64  `tfsdk:"user_data_wo_version"`
	WaitFor           types.String `tfsdk:"wait_for"`
	GuestAgent        types.Bool   `tfsdk:"guest_agent"`
}

// guestResourceAttributes are kvm_vm's guest configuration attributes.
func guestResourceAttributes() map[string]schema.Attribute {
	replace := "Part of the guest configuration, which the guest reads once, at its first boot, from its " +
		"NoCloud seed disk: **changing it replaces the VM** (the plan shows a replace; the new VM has a new id, " +
		"disk and instance-id)."
	return map[string]schema.Attribute{
		"user_data": schema.StringAttribute{
			MarkdownDescription: "Cloud-init user data for the guest (`#cloud-config` YAML, a shell script, or any " +
				"other format cloud-init takes), at most 64 KiB (65,536 bytes). " + replace + " Kept in state as a " +
				"sensitive value; the control API never returns it, only its `user_data_sha256`, which is how a " +
				"refresh notices user data that differs from the configuration (shown as a replace). To keep it " +
				"out of state, use `user_data_wo` instead. A VM with user data (or any guest configuration) boots " +
				"cold, never from a host's warm pool: the pool's VMs booted before their seed could exist " +
				"(`started_from` says `cold`).",
			Optional:   true,
			Sensitive:  true,
			Validators: []validator.String{maxBytes(api.MaxUserDataBytes, "64 KiB"), stringvalidator.ConflictsWith(path.MatchRoot("user_data_wo"))},
			// Replacement is decided by ModifyPlan on user_data_sha256, so
			// that an imported VM whose user data matches is not replaced.
		},
		"user_data_wo": schema.StringAttribute{
			MarkdownDescription: "Write-only form of `user_data` (Terraform or OpenTofu 1.11 or later): the same limit and " +
				"meaning, but the value is never stored in the plan or the state. State keeps only its " +
				"`user_data_sha256` (which the control API reports as well), so a change of the value still " +
				"shows as a replace; bump `user_data_wo_version` to replace the VM with the same value.",
			Optional:   true,
			Sensitive:  true,
			WriteOnly:  true,
			Validators: []validator.String{maxBytes(api.MaxUserDataBytes, "64 KiB")},
		},
		"user_data_wo_version": schema.Int64Attribute{
			MarkdownDescription: "Version of `user_data_wo`, any number you choose: changing it from one number to " +
				"another replaces the VM, which then reads `user_data_wo` afresh.",
			Optional:      true,
			PlanModifiers: []planmodifier.Int64{int64planmodifier.RequiresReplaceIf(changedFromKnown, "A change of the version replaces the VM.", "A change of the version replaces the VM.")},
		},
		"ssh_authorized_keys": schema.ListAttribute{
			MarkdownDescription: "OpenSSH public keys (one key per element, e.g. `file(\"~/.ssh/id_ed25519.pub\")`, " +
				"at most 32) that cloud-init installs for the image's default user (`debian` on the Debian image). " +
				replace,
			ElementType:   types.StringType,
			Optional:      true,
			Validators:    []validator.List{listvalidator.SizeAtMost(api.MaxSSHAuthorizedKeys), listvalidator.ValueStringsAre(authorizedKey{})},
			PlanModifiers: []planmodifier.List{listplanmodifier.RequiresReplace()},
		},
		"meta_data": schema.MapAttribute{
			MarkdownDescription: "Extra NoCloud meta-data keys. `local-hostname` sets the guest's hostname " +
				"(default: the VM's name made a valid hostname). `instance-id` (always the VM's id, so each VM, and " +
				"each child of a `kvm_fork`, is a new instance to cloud-init) and `public-keys` (set from " +
				"`ssh_authorized_keys`) are set by the product and refused here. " + replace,
			ElementType:   types.StringType,
			Optional:      true,
			Validators:    []validator.Map{reservedMetaData{}},
			PlanModifiers: []planmodifier.Map{mapplanmodifier.RequiresReplace()},
		},
		"network_config": schema.StringAttribute{
			MarkdownDescription: "Cloud-init network configuration (version 1 or 2, YAML or JSON), at most 64 KiB. " +
				"Left out, it is generated from the VM's NICs: each is matched by its MAC address and named `ethN`, " +
				"with its static address and gateway where the network assigns one and DHCP where it hands out " +
				"addresses. " + replace,
			Optional:      true,
			Validators:    []validator.String{maxBytes(api.MaxNetworkConfigBytes, "64 KiB")},
			PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
		},
		"hostname": schema.StringAttribute{
			MarkdownDescription: "The guest's hostname as its seed gives it: `meta_data[\"local-hostname\"]`, else " +
				"the VM's name made a valid hostname; null for a VM without guest configuration. A later rename " +
				"of the VM does not change it.",
			Computed:      true,
			PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
		},
		"user_data_sha256": schema.StringAttribute{
			MarkdownDescription: "Hex SHA-256 of the user data (`user_data` or `user_data_wo`) as the control API " +
				"holds it; null without user data. The plan computes it from the configuration: when it differs " +
				"from the one in state (changed user data, or a VM whose user data differs from the " +
				"configuration), the plan replaces the VM.",
			Computed: true,
		},
		"wait_for": schema.StringAttribute{
			MarkdownDescription: "What a create (and an update of a running VM) waits for, within its timeout: " +
				"`running` (default: the host runs the VM), `ip` (the guest reported an IPv4 address on its " +
				"serial console) or `cloud_init` (cloud-init in the guest reported that it finished). A wait that " +
				"times out fails with the last lines of the VM's serial console in the error; the VM is kept in " +
				"state as tainted, so the next apply replaces it and nothing is left behind. `ip` and `cloud_init` " +
				"need a running VM and an image that reports them (the Debian cloud image does, and the busybox " +
				"image does when it has guest configuration). `agent` waits for the QEMU guest agent to answer " +
				"(it needs `guest_agent = true` and an image that runs `qemu-guest-agent`, as the Debian image " +
				"does); the addresses it reports are then in each `network_interface`'s `ipv4_addresses` right " +
				"after apply. Changing it changes nothing on the VM.",
			Optional:   true,
			Computed:   true,
			Default:    stringdefault.StaticString(waitForRunning),
			Validators: []validator.String{stringvalidator.OneOf(waitForRunning, waitForIP, waitForCloudInit, waitForAgent)},
		},
		"guest_agent": schema.BoolAttribute{
			MarkdownDescription: "Adds the QEMU guest agent channel (a virtio-serial port named " +
				"`org.qemu.guest_agent.0`). When the guest runs `qemu-guest-agent` (the Debian image does; install " +
				"it in your own images), the addresses it reports appear in each `network_interface`'s " +
				"`ipv4_addresses` (on every network mode, also where the network assigns no address), " +
				"`wait_for = \"agent\"` can wait for it, a stop asks it to power the guest off before the ACPI " +
				"power button, and a `kvm_fork`'s snapshot freezes the guest's file systems so that each child's " +
				"disk is consistent. Without a guest agent in the guest the VM behaves as without the channel. " +
				"A VM with it boots cold (the warm pool's VMs have no channel); a fork's children inherit it. " +
				"Default `false`; **changing it replaces the VM**.",
			Optional:      true,
			Computed:      true,
			Default:       booldefault.StaticBool(false),
			PlanModifiers: []planmodifier.Bool{boolplanmodifier.RequiresReplace()},
		},
	}
}

// changedFromKnown asks for a replace when a known value changes to another:
// setting a value the state did not have (an import) is no reason to replace.
func changedFromKnown(_ context.Context, req planmodifier.Int64Request, resp *int64planmodifier.RequiresReplaceIfFuncResponse) {
	resp.RequiresReplace = !req.StateValue.IsNull() && !req.PlanValue.Equal(req.StateValue)
}

// maxBytesValidator bounds a string's length in bytes (what the control API
// counts), naming the limit and the size given.
type maxBytesValidator struct {
	max   int
	human string
}

func maxBytes(n int, human string) validator.String { return maxBytesValidator{max: n, human: human} }

func (v maxBytesValidator) Description(context.Context) string {
	return fmt.Sprintf("at most %d bytes (%s)", v.max, v.human)
}

func (v maxBytesValidator) MarkdownDescription(ctx context.Context) string { return v.Description(ctx) }

func (v maxBytesValidator) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	if n := len(req.ConfigValue.ValueString()); n > v.max {
		resp.Diagnostics.AddAttributeError(req.Path, "Guest Configuration Too Large", fmt.Sprintf(
			"%s is %d bytes; the limit is %d bytes (%s). Keep large files out of it: let the guest fetch them "+
				"(for example with a runcmd or write_files pointing at a URL), or build them into the image.",
			req.Path, n, v.max, v.human))
	}
}

// authorizedKey checks that a string is one OpenSSH authorized key.
type authorizedKey struct{}

func (authorizedKey) Description(context.Context) string {
	return "one OpenSSH public key, e.g. ssh-ed25519 AAAA... user@host"
}

func (v authorizedKey) MarkdownDescription(ctx context.Context) string { return v.Description(ctx) }

func (authorizedKey) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	if err := parseAuthorizedKey(req.ConfigValue.ValueString()); err != nil {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid SSH Public Key", fmt.Sprintf(
			"%s is not an OpenSSH public key: %s. Give one key per element, as one line such as "+
				"\"ssh-ed25519 AAAAC3Nz... user@host\" (the .pub file of a key pair, never the private key).", req.Path, err))
	}
}

// parseAuthorizedKey accepts what the control API accepts: one line holding
// one key, surrounding white space (a .pub file's newline) ignored.
func parseAuthorizedKey(k string) error {
	line := strings.TrimSpace(k)
	switch {
	case line == "":
		return fmt.Errorf("it is empty")
	case strings.ContainsAny(line, "\r\n"):
		return fmt.Errorf("it spans several lines")
	}
	_, _, _, rest, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return fmt.Errorf("it holds more than one key")
	}
	return nil
}

// reservedMetaData refuses the meta-data keys the product sets itself.
type reservedMetaData struct{}

func (reservedMetaData) Description(context.Context) string {
	return "no instance-id or public-keys key: the product sets them"
}

func (v reservedMetaData) MarkdownDescription(ctx context.Context) string { return v.Description(ctx) }

func (reservedMetaData) ValidateMap(_ context.Context, req validator.MapRequest, resp *validator.MapResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	for _, k := range slices.Sorted(maps.Keys(req.ConfigValue.Elements())) {
		switch k {
		case api.MetaInstanceID:
			resp.Diagnostics.AddAttributeError(req.Path.AtMapKey(k), "Reserved Meta-Data Key", fmt.Sprintf(
				"meta_data may not set %q: the product sets it to the VM's id, so that every VM (and every child "+
					"of a kvm_fork) is a new instance to cloud-init. Remove the key.", k))
		case api.MetaPublicKeys:
			resp.Diagnostics.AddAttributeError(req.Path.AtMapKey(k), "Reserved Meta-Data Key", fmt.Sprintf(
				"meta_data may not set %q: the product sets it from ssh_authorized_keys. Give the keys there.", k))
		}
	}
}

// userDataDigest is the hex SHA-256 the control API reports for user data;
// null for none.
func userDataDigest(userData string) types.String {
	if userData == "" {
		return types.StringNull()
	}
	sum := sha256.Sum256([]byte(userData))
	return types.StringValue(hex.EncodeToString(sum[:]))
}

// configuredDigest is the digest of the user data a configuration gives
// (user_data or the write-only user_data_wo, both readable in the config),
// unknown while either is unknown.
func configuredDigest(userData, userDataWO types.String) types.String {
	switch {
	case userData.IsUnknown() || userDataWO.IsUnknown():
		return types.StringUnknown()
	case userData.ValueString() != "":
		return userDataDigest(userData.ValueString())
	default:
		return userDataDigest(userDataWO.ValueString())
	}
}

// guestCreate fills a create's guest configuration from the plan and (for the
// write-only user data) the config.
func guestCreate(ctx context.Context, in *api.VMCreate, plan *vmModel, userDataWO types.String) diag.Diagnostics {
	var diags diag.Diagnostics
	in.UserData = plan.UserData.ValueString()
	if in.UserData == "" {
		in.UserData = userDataWO.ValueString()
	}
	in.NetworkConfig = plan.NetworkConfig.ValueString()
	in.GuestAgent = plan.GuestAgent.ValueBool()
	if !plan.SSHAuthorizedKeys.IsNull() && !plan.SSHAuthorizedKeys.IsUnknown() {
		diags.Append(plan.SSHAuthorizedKeys.ElementsAs(ctx, &in.SSHAuthorizedKeys, false)...)
	}
	if !plan.MetaData.IsNull() && !plan.MetaData.IsUnknown() {
		diags.Append(plan.MetaData.ElementsAs(ctx, &in.MetaData, false)...)
	}
	return diags
}

// guestFromAPI sets the guest attributes a VM reports, keeping the prior
// value (plan or state) of each configured one where it means the same as
// the API's: an empty list or map for none, a key with its .pub file's
// newline that the control API stored trimmed.
func (m *vmAttributes) guestFromAPI(vm api.VM) {
	m.Hostname = optionalString(vm.Hostname)
	m.UserDataSHA256 = optionalString(vm.UserDataSHA256)
	if m.SSHAuthorizedKeys.IsNull() || !sameKeys(m.SSHAuthorizedKeys, vm.SSHAuthorizedKeys) {
		m.SSHAuthorizedKeys = types.ListNull(types.StringType)
		if len(vm.SSHAuthorizedKeys) > 0 {
			m.SSHAuthorizedKeys = stringList(vm.SSHAuthorizedKeys)
		}
	}
	if m.MetaData.IsNull() || !sameMetaData(m.MetaData, vm.MetaData) {
		m.MetaData = types.MapNull(types.StringType)
		if len(vm.MetaData) > 0 {
			m.MetaData = labelsValue(vm.MetaData)
		}
	}
	if m.NetworkConfig.ValueString() != vm.NetworkConfig || m.NetworkConfig.IsUnknown() {
		m.NetworkConfig = optionalString(vm.NetworkConfig)
	}
}

func sameKeys(prior types.List, got []string) bool {
	if prior.IsUnknown() {
		return false
	}
	elems := prior.Elements()
	if len(elems) != len(got) {
		return false
	}
	for i, e := range elems {
		s, ok := e.(types.String)
		if !ok || strings.TrimSpace(s.ValueString()) != strings.TrimSpace(got[i]) {
			return false
		}
	}
	return true
}

func sameMetaData(prior types.Map, got map[string]string) bool {
	if prior.IsUnknown() {
		return false
	}
	elems := prior.Elements()
	if len(elems) != len(got) {
		return false
	}
	for k, e := range elems {
		s, ok := e.(types.String)
		v, present := got[k]
		if !ok || !present || s.ValueString() != v {
			return false
		}
	}
	return true
}

// guestStates are the states waitForGuest distinguishes.
const (
	guestWaiting = "waiting"
	guestReady   = "ready"
	guestFailed  = "failed"
)

// waitForGuest reads what the VM's guest reported on its console until it
// is what wait_for asks for (an address, or cloud-init finished) or ctx ends.
// A busybox guest also reports the digest of the user data it read, which
// must be the applied one.
func waitForGuest(ctx context.Context, c *client.Client, vm api.VM, waitFor string) (api.GuestStatus, error) {
	state := func(g api.GuestStatus) string {
		if waitFor == waitForAgent {
			if g.GuestAgent == api.GuestAgentReady {
				return guestReady
			}
			return guestWaiting
		}
		if waitFor == waitForIP {
			if len(g.IPv4Addresses) > 0 {
				return guestReady
			}
			return guestWaiting
		}
		switch g.CloudInit {
		case api.CloudInitDone:
			if g.UserDataSHA256 != "" && g.UserDataSHA256 != vm.UserDataSHA256 {
				return guestFailed
			}
			return guestReady
		case api.CloudInitError:
			return guestFailed
		}
		return guestWaiting
	}
	return stateChange[api.GuestStatus]{
		Pending: []string{guestWaiting},
		Target:  []string{guestReady},
		Refresh: func(ctx context.Context) (api.GuestStatus, string, error) {
			g, err := c.VMGuest(ctx, vm.ID)
			if err != nil {
				return g, "", fmt.Errorf("reading the guest status of VM %s: %w", vm.ID, err)
			}
			return g, state(g), nil
		},
		Unexpected: func(g api.GuestStatus, _ string) error {
			if g.CloudInit == api.CloudInitError {
				if len(g.CloudInitErrors) == 0 {
					return errors.New("cloud-init in the guest reported an error")
				}
				quoted := make([]string, len(g.CloudInitErrors))
				for i, l := range g.CloudInitErrors {
					quoted[i] = strconv.Quote(l)
				}
				return fmt.Errorf("cloud-init in the guest reported an error (its console: %s)", strings.Join(quoted, "; "))
			}
			return fmt.Errorf("the guest read user data with SHA-256 %s, but the VM's is %s", g.UserDataSHA256, vm.UserDataSHA256)
		},
		TimedOut: func(g api.GuestStatus, _ string, err error) error {
			if waitFor == waitForAgent {
				return fmt.Errorf("the QEMU guest agent had not answered (its state: %q) when the timeout ended; "+
					"check that the image runs qemu-guest-agent: %w", g.GuestAgent, err)
			}
			if waitFor == waitForIP {
				return fmt.Errorf("the guest reported no IPv4 address on its console when the timeout ended: %w", err)
			}
			return fmt.Errorf("cloud-init in the guest had not finished (its state: %q) when the timeout ended: %w", g.CloudInit, err)
		},
		// A guest takes seconds to boot: a read every second is plenty.
		MaxInterval: time.Second,
	}.wait(ctx)
}

// consoleTail is the last lines of a VM's serial console, for an error, read
// with a fresh deadline (the operation's may be spent); a failure to read it
// says so instead.
func consoleTail(ctx context.Context, c *client.Client, id string, lines int) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	out, err := c.VMConsole(ctx, id, consoleTailBytes)
	if err != nil {
		tflog.Warn(ctx, "reading the console of a VM whose wait failed", map[string]any{"id": id, "error": err.Error()})
		return fmt.Sprintf("(the serial console could not be read: %s; read it later with the kvm_vm_console data source)", err)
	}
	return lastLines(out, lines)
}

// terminalControl matches the escape sequences (colours, cursor moves) and
// carriage returns a boot console prints, which make an error unreadable.
var terminalControl = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]|\r`)

// lastLines is the last n lines of s, without terminal control sequences and
// the last line's newline.
func lastLines(s string, n int) string {
	s = strings.TrimRight(terminalControl.ReplaceAllString(s, ""), "\n")
	if s == "" {
		return "(the serial console is empty)"
	}
	all := strings.Split(s, "\n")
	if len(all) > n {
		all = all[len(all)-n:]
	}
	return strings.Join(all, "\n")
}
