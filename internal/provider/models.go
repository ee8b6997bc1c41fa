package provider

import (
	"fmt"
	"sort"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// hostModel is a host as the kvm_host resource stores it.
type hostModel struct {
	Name               types.String  `tfsdk:"name"`
	Address            types.String  `tfsdk:"address"`
	UnderlayAddress    types.String  `tfsdk:"underlay_address"`
	Labels             types.Map     `tfsdk:"labels"`
	Schedulable        types.Bool    `tfsdk:"schedulable"`
	CPUAllocationRatio types.Float64 `tfsdk:"cpu_allocation_ratio"`
	MemoryReservedMiB  types.Int64   `tfsdk:"memory_reserved_mib"`
	Capacity           types.Object  `tfsdk:"capacity"`
	Allocated          types.Object  `tfsdk:"allocated"`
	Free               types.Object  `tfsdk:"free"`
	Alive              types.Bool    `tfsdk:"alive"`
	Accel              types.String  `tfsdk:"accel"`
	Driver             types.String  `tfsdk:"driver"`
	Images             types.List    `tfsdk:"images"`
	WarmPool           types.List    `tfsdk:"warm_pool"`
	Warm               types.Object  `tfsdk:"warm"`
	Isolation          types.String  `tfsdk:"isolation"`
	Retired            types.Bool    `tfsdk:"retired"`
	RetiredAt          types.String  `tfsdk:"retired_at"`
	Drain              types.Bool    `tfsdk:"drain"`
	DrainStatus        types.Object  `tfsdk:"drain_status"`
}

func (m *hostModel) fromAPI(h api.Host) {
	m.Name = types.StringValue(h.Name)
	m.Address = types.StringValue(h.Address)
	m.UnderlayAddress = optionalString(h.UnderlayAddress)
	m.Labels = labelsValue(h.Labels)
	m.Schedulable = types.BoolValue(h.Schedulable)
	m.CPUAllocationRatio = types.Float64Value(h.CPUAllocationRatio)
	m.MemoryReservedMiB = types.Int64Value(h.MemoryReservedMiB)
	m.Capacity = resourcesObject(h.Capacity)
	m.Allocated = resourcesObject(h.Allocated)
	m.Free = resourcesObject(h.Free)
	m.Alive = types.BoolValue(h.Alive)
	m.Accel = types.StringValue(h.Accel)
	m.Driver = types.StringValue(h.Driver)
	m.Images = stringList(h.Images)
	m.WarmPool = warmPoolValue(h.WarmPool)
	m.Warm = resourcesObject(h.Warm)
	m.Isolation = types.StringValue(h.Isolation)
	m.Retired = types.BoolValue(h.RetiredAt != nil)
	m.RetiredAt = types.StringNull()
	if h.RetiredAt != nil {
		m.RetiredAt = timestamp(*h.RetiredAt)
	}
	m.Drain = types.BoolValue(h.Drain.State != api.DrainNone)
	m.DrainStatus = drainStatusValue(h.Drain)
}

// hostDataModel is a host as the data sources show it: the resource's
// attributes plus when the control API last heard from the agent.
type hostDataModel struct {
	hostModel
	LastSeen types.String `tfsdk:"last_seen"`
}

func (m *hostDataModel) fromAPI(h api.Host) {
	m.hostModel.fromAPI(h)
	m.WarmPool = warmPoolDataValue(h.WarmPool)
	m.LastSeen = types.StringNull()
	if h.LastSeen != nil {
		m.LastSeen = timestamp(*h.LastSeen)
	}
}

// vmAttributes are the attributes kvm_vm (resource and data source) share.
type vmAttributes struct {
	ID               types.String  `tfsdk:"id"`
	Name             types.String  `tfsdk:"name"`
	Project          types.String  `tfsdk:"project"`
	Image            types.String  `tfsdk:"image"`
	VCPUs            types.Int64   `tfsdk:"vcpus"`
	MemoryMiB        types.Int64   `tfsdk:"memory_mib"`
	DiskMiB          types.Int64   `tfsdk:"disk_mib"`
	Host             types.String  `tfsdk:"host"`
	PowerState       types.String  `tfsdk:"power_state"`
	Labels           types.Map     `tfsdk:"labels"`
	ObservedState    types.String  `tfsdk:"observed_state"`
	StartedFrom      types.String  `tfsdk:"started_from"`
	PlacementScore   types.Float64 `tfsdk:"placement_score"`
	PlacementSummary types.String  `tfsdk:"placement_summary"`
	CreatedAt        types.String  `tfsdk:"created_at"`
	IPv4Address      types.String  `tfsdk:"ipv4_address"`
	// Constraints is the constraints block (null when absent).
	Constraints         types.Object `tfsdk:"constraints"`
	ConstraintsViolated types.String `tfsdk:"constraints_violated"`
	// Guest configuration the control API reports (the user data itself
	// it never returns).
	SSHAuthorizedKeys types.List   `tfsdk:"ssh_authorized_keys"`
	MetaData          types.Map    `tfsdk:"meta_data"`
	NetworkConfig     types.String `tfsdk:"network_config"`
	Hostname          types.String `tfsdk:"hostname"`
	UserDataSHA256    types.String `tfsdk:"user_data_sha256"`
	SecureBoot        types.Bool   `tfsdk:"secure_boot"`
}

// fromAPI fills the attributes from vm, with powerState as the value of
// power_state (desired after a write, observed after a read). m's
// constraints before the call (plan or prior state) settle how an empty
// block reads back.
func (m *vmAttributes) fromAPI(vm api.VM, powerState string) {
	m.Constraints = constraintsObject(vm.Constraints, m.Constraints)
	m.ConstraintsViolated = types.StringValue(vm.ConstraintsViolated)
	m.ID = types.StringValue(vm.ID)
	m.Name = types.StringValue(vm.Name)
	m.Project = optionalString(vm.Project)
	m.Image = types.StringValue(vm.Image)
	m.VCPUs = types.Int64Value(vm.VCPUs)
	m.MemoryMiB = types.Int64Value(vm.MemoryMiB)
	m.DiskMiB = types.Int64Value(vm.DiskMiB)
	m.Host = optionalString(vm.Host)
	m.PowerState = types.StringValue(powerState)
	m.Labels = labelsValue(vm.Labels)
	m.ObservedState = optionalString(vm.ObservedState)
	m.StartedFrom = optionalString(vm.StartedFrom)
	m.PlacementScore = types.Float64Null()
	m.PlacementSummary = types.StringNull()
	if vm.Placement != nil {
		m.PlacementScore = scoreValue(vm.Placement.Score)
		m.PlacementSummary = types.StringValue(placementSummary(vm.Host, vm.Placement))
	}
	m.CreatedAt = timestamp(vm.CreatedAt)
	m.IPv4Address = optionalString(vm.IPv4Address)
	m.SecureBoot = types.BoolValue(vm.SecureBoot)
	m.guestFromAPI(vm)
}

// desiredPowerState is the power state the control API was asked for.
func desiredPowerState(vm api.VM) string {
	if vm.PowerState == "" {
		return api.PowerRunning
	}
	return vm.PowerState
}

// observedPowerState is the power state a refresh reports: what the host
// last saw when it is definite (running or stopped), else what was asked
// for. A VM stopped behind Terraform's back thus reads as "stopped", and the
// plan shows the change back to "running".
func observedPowerState(vm api.VM) string {
	switch vm.ObservedState {
	case api.StateRunning:
		return api.PowerRunning
	case api.StateStopped:
		return api.PowerStopped
	}
	return desiredPowerState(vm)
}

// maxRejectionsInSummary keeps placement_summary short on big fleets.
const maxRejectionsInSummary = 3

// placementSummary explains a placement in one line: the host and score, and
// why other hosts were rejected.
func placementSummary(host string, p *api.Placement) string {
	if p.Host != "" {
		host = p.Host
	}
	var b strings.Builder
	fmt.Fprintf(&b, "placed on %s (score %.5f)", host, p.Score)
	if len(p.Rejected) == 0 {
		return b.String()
	}
	rej := append([]api.Rejection(nil), p.Rejected...)
	sort.Slice(rej, func(i, j int) bool { return rej[i].Host < rej[j].Host })
	parts := make([]string, 0, maxRejectionsInSummary)
	for i, r := range rej {
		if i == maxRejectionsInSummary {
			break
		}
		parts = append(parts, fmt.Sprintf("%s: %s", r.Host, r.Reason))
	}
	fmt.Fprintf(&b, "; rejected %s", strings.Join(parts, "; "))
	if n := len(rej) - maxRejectionsInSummary; n > 0 {
		fmt.Fprintf(&b, "; and %d more", n)
	}
	return b.String()
}
