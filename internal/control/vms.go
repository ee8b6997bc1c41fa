package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

// createTimeout bounds a whole create: placement, the agent's boot (which
// can be slow under TCG) and the cleanup of a failure.
const createTimeout = 10 * time.Minute

// idempotencyScopeVMs scopes the Idempotency-Keys of VM creates.
const idempotencyScopeVMs = "POST /v1/vms"

// CreateVM places, reserves and starts a VM. With an idempotency key, a
// retry of the same request returns the same VM instead of a second one.
func (s *Service) CreateVM(ctx context.Context, in api.VMCreate, idempotencyKey string) (api.VM, error) {
	if err := validateVMCreate(in); err != nil {
		return api.VM{}, err
	}
	if in.PowerState == "" {
		in.PowerState = api.PowerRunning
	}
	if idempotencyKey == "" {
		return s.createVM(ctx, in)
	}
	return idempotent(ctx, s, idempotencyScopeVMs, idempotencyKey, in, func(ctx context.Context) (api.VM, error) {
		return s.createVM(ctx, in)
	})
}

// createVM runs docs/guides/architecture.md: reserve (DB) -> agent PUT -> mark
// created (DB). Every step that succeeds pushes its undo on a cleanup
// chain; a failure runs the chain, so the agent deletes the VM before its
// capacity is released.
func (s *Service) createVM(ctx context.Context, in api.VMCreate) (api.VM, error) {
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	step := time.Now()
	img, err := s.registeredImage(ctx, in.Image, in.DiskMiB)
	if err != nil {
		return api.VM{}, err
	}
	if in.SecureBoot && img != nil && img.Firmware != api.FirmwareUEFI {
		return api.VM{}, invalidf("secure_boot needs an image with firmware uefi; image %s boots with firmware %s", img.Name, img.Firmware)
	}
	builtin := in.Image
	if img != nil {
		builtin = "" // any host fetches a registered image
	}
	if err := s.checkPlaceable(ctx, builtin, in.Host); err != nil {
		return api.VM{}, err
	}
	project, err := s.placementProject(ctx, in.Project)
	if err != nil {
		return api.VM{}, err
	}
	if err := checkProjectLabels(in.Constraints, project); err != nil {
		return api.VM{}, err
	}
	if existing, err := s.store.GetVMByName(ctx, project.Name, in.Name); err == nil {
		return api.VM{}, s.nameTaken(ctx, project.Name, existing.Name, nil)
	}
	vm := store.VM{
		ID: newID(), Name: in.Name, Project: project.Name, Image: in.Image, Labels: in.Labels,
		Resources:  store.Resources{VCPUs: in.VCPUs, MemoryMiB: in.MemoryMiB, DiskMiB: in.DiskMiB},
		PowerState: in.PowerState, ObservedState: api.StateCreating, Constraints: constraintsText(in.Constraints),
		CreatedAt: time.Now().UTC().Truncate(time.Microsecond), Owner: &s.replicaID, Guest: guestOf(in),
		GuestAgent: in.GuestAgent, SecureBoot: in.SecureBoot,
	}
	var volumeHost string
	if vm.Volumes, _, volumeHost, err = s.vmVolumes(ctx, project.Name, in.Volumes); err != nil {
		return api.VM{}, err
	}
	nics, err := s.resolveNICs(ctx, vm.ID, project.Name, in.NetworkInterfaces)
	if err != nil {
		return api.VM{}, err
	}
	// The VM keeps the constraints it was asked with; placement also
	// holds it to its project's hosts, and to its volumes' host.
	req := scheduler.Request{Image: in.Image, Host: in.Host, Resources: schedResources(vm.Resources), VolumeHost: volumeHost}
	if img != nil {
		req.ImageSHA256 = img.SHA256
	}
	step = timing.Since(ctx, "checks", step)
	if err := s.placeInProject(ctx, &vm, nics, req, in.Constraints, project); err != nil {
		return api.VM{}, err
	}
	step = timing.Since(ctx, "placement", step)
	chain := &cleanup{log: s.log.With("vm", vm.ID, "host", vm.HostName)}
	chain.push("release capacity", func(ctx context.Context) error { return s.forgetVM(ctx, vm.ID, vm.HostName) })

	address, _, _ := s.view.agent(vm.HostName)
	agent := s.agents.client(address)
	// Pushed before the PUT: a timeout leaves it unknown whether the agent
	// created the VM, so any failure from here on deletes it there first.
	chain.push("delete on agent", func(ctx context.Context) error {
		err := s.agents.deleteVM(ctx, agent, vm.ID)
		if errors.Is(err, agentapi.ErrNotFound) {
			return nil
		}
		return err
	})
	spec := agentapi.VMSpec{Image: vm.Image, VCPUs: vm.Resources.VCPUs, MemoryMiB: vm.Resources.MemoryMiB,
		DiskMiB: vm.Resources.DiskMiB, Stopped: in.PowerState == api.PowerStopped,
		NICs: agentNICs(nics), NoWarm: !warmCapable(nics) || vm.Guest != nil || vm.GuestAgent || vm.SecureBoot, Seed: seedSpec(vm.ID, vm.Guest),
		HostCapacity: s.view.hostCapacity(vm.HostName), Volumes: agentVolumes(vm.Volumes), GuestAgent: vm.GuestAgent, SecureBoot: vm.SecureBoot}
	if img != nil {
		src := s.imageSource(*img, vm.HostName)
		spec.ImageSource = &src
		spec.Firmware = img.Firmware
		// The fetch may outlast one agent call: wait for it here, with the
		// create's own deadline, so the create call itself only boots.
		if err := s.awaitImage(ctx, agent, vm.HostName, src); err != nil {
			return api.VM{}, s.failCreate(ctx, chain, vm, err)
		}
	}
	step = timing.Since(ctx, "image", step)
	created, err := s.agents.createVM(ctx, agent, vm.ID, spec)
	if err != nil {
		return api.VM{}, s.failCreate(ctx, chain, vm, fromAgent(err, vm.HostName, "create VM "+vm.ID))
	}
	step = timing.Since(ctx, "agent", step)
	if err := s.recordAgentNICs(ctx, &vm, created); err != nil {
		return api.VM{}, s.failCreate(ctx, chain, vm, fromStore(err, "record NICs of VM "+vm.ID))
	}
	if img != nil {
		s.noteImageOnHost(ctx, vm.HostName, agent, *img)
	}
	if hook := s.hooks.AfterAgentCreate; hook != nil {
		if err := hook(ctx, vm.ID); err != nil {
			return api.VM{}, s.failCreate(ctx, chain, vm, internal(err, "record created VM "+vm.ID))
		}
	}
	if err := s.store.MarkVMCreated(ctx, vm.ID, created.State, created.Reason, created.StartedFrom); err != nil {
		return api.VM{}, s.failCreate(ctx, chain, vm, fromStore(err, "record created VM "+vm.ID))
	}
	timing.Since(ctx, "record", step)
	chain.commit()
	vm.ObservedState, vm.Reason, vm.StartedFrom = created.State, created.Reason, created.StartedFrom
	s.log.Info("vm created", "vm", vm.ID, "name", vm.Name, "host", vm.HostName, "state", created.State)
	return s.withConstraints(apiVM(vm, true), vm), nil
}

// recordAgentNICs stores what the agent chose for the VM's NICs (forwarded
// host ports; the MAC of a warm VM's NIC) when it differs from the plan.
func (s *Service) recordAgentNICs(ctx context.Context, vm *store.VM, created agentapi.VM) error {
	if !mergeAgentNICs(vm.NICs, created.NICs) {
		return nil
	}
	return s.store.SetVMNICs(ctx, vm.ID, vm.NICs)
}

// failCreate runs the cleanup chain of a failed create and returns cause.
// When the agent could not confirm the delete, the VM may still run, so the
// row stays with its capacity reserved and says how to finish the cleanup.
func (s *Service) failCreate(ctx context.Context, chain *cleanup, vm store.VM, cause error) error {
	s.log.Warn("vm create failed; cleaning up", "vm", vm.ID, "host", vm.HostName, "err", cause)
	undoErr := chain.run(ctx)
	if undoErr == nil {
		return cause
	}
	reason := fmt.Sprintf(createFailedPrefix+" (%v) and the agent of host %s did not confirm deleting the VM, so its capacity stays reserved; DELETE /v1/vms/%s retries the cleanup", cause, vm.HostName, vm.ID)
	if err := s.store.SetVMState(ctx, vm.ID, api.StateError, reason, ""); err != nil {
		s.log.Error("record failed create", "vm", vm.ID, "err", err)
	}
	var e *Error
	if errors.As(cause, &e) {
		e.Message += fmt.Sprintf("; VM %s is kept in state error until its host confirms the delete (DELETE it to retry)", vm.ID)
		e.Details = map[string]any{"vm_id": vm.ID}
	}
	return cause
}

// forgetVM releases a VM's capacity and removes its row (the last undo of
// a failed create, and the end of a delete).
func (s *Service) forgetVM(ctx context.Context, id, host string) error {
	vm, _, err := s.store.DeleteVM(ctx, id)
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return err
	}
	s.refreshHost(ctx, host)
	if s.onOverlay(ctx, vm.NICs) {
		s.kickOverlays()
	}
	return nil
}

// checkPlaceable refuses requests that no amount of capacity could place:
// an image that no host offers and an unregistered pinned host.
func (s *Service) checkPlaceable(ctx context.Context, image, host string) error {
	known := func() bool {
		_, _, hostKnown := s.view.agent(host)
		return (image == "" || s.view.hasImage(image)) && (host == "" || hostKnown)
	}
	if !known() {
		// Another replica may have registered it: look again before refusing.
		if err := s.refreshView(ctx); err != nil {
			return internal(err, "load hosts")
		}
	}
	if host != "" {
		if _, _, ok := s.view.agent(host); !ok {
			return invalidf("host %q is not registered", host)
		}
	}
	if image != "" && !s.view.hasImage(image) {
		return invalidf("image %q is not offered by any registered host", image)
	}
	return nil
}

// GetVM returns one VM.
func (s *Service) GetVM(ctx context.Context, id string) (api.VM, error) {
	vm, err := s.visibleVM(ctx, id)
	if err != nil {
		return api.VM{}, fromStore(err, "read vm "+id)
	}
	out, err := s.apiVMs(ctx, []store.VM{vm})
	if err != nil {
		return api.VM{}, err
	}
	s.withGuestAgentAddresses(ctx, vm, &out[0])
	return out[0], nil
}

// VMQuery filters and pages a VM list.
type VMQuery struct {
	Page
	Host   string
	Name   string
	Label  string // key=value
	ForkID string
}

// ListVMs returns one page of VMs matching q.
func (s *Service) ListVMs(ctx context.Context, q VMQuery) (api.List[api.VM], error) {
	f := store.VMFilter{Project: principalOf(ctx).Project, Host: q.Host, Name: q.Name, ForkID: q.ForkID}
	if q.Label != "" {
		var err error
		if f.LabelKey, f.LabelValue, err = parseLabelFilter(q.Label); err != nil {
			return api.List[api.VM]{}, err
		}
	}
	return listPage(q.Page, func(after string, limit int) ([]store.VM, error) {
		f.After, f.Limit = after, limit
		vms, err := s.store.ListVMs(ctx, f)
		return vms, fromStore(err, "list vms")
	}, func(vm store.VM) string { return vm.ID }, func(vms []store.VM) ([]api.VM, error) { return s.apiVMs(ctx, vms) })
}

// UpdateVM changes a VM in place: its name, its shape (vCPUs and memory,
// resize.go), its disk size (grown only, disk.go), its power state, its
// labels and its stored constraints (the VM does not move). Asking for the power state a VM already has still acts
// when the agent reports otherwise: that is how an apply repairs a VM
// stopped behind Terraform's back. A VM to be stopped is stopped before its
// resize (which then only records the shape); one to run is resized first
// (the restart brings it up in the new shape).
func (s *Service) UpdateVM(ctx context.Context, id string, in api.VMPatch) (api.VM, error) {
	if err := validateVMPatch(in); err != nil {
		return api.VM{}, err
	}
	if err := validateConstraints(in.Constraints); err != nil {
		return api.VM{}, err
	}
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	vm, err := s.visibleVM(ctx, id)
	if err != nil {
		return api.VM{}, fromStore(err, "read vm "+id)
	}
	// The disk growth is reserved first: with the name it is what can be
	// refused (a shrink, no room), and a refused PATCH changes nothing. It
	// is applied after the resize, and given back if a step before fails.
	var disk *diskGrowth
	if in.DiskMiB != nil {
		if disk, err = s.reserveDiskGrowth(ctx, vm, *in.DiskMiB); err != nil {
			return api.VM{}, err
		}
	}
	fail := func(err error) (api.VM, error) {
		if disk != nil {
			disk.undo(ctx, s)
		}
		return api.VM{}, err
	}
	if in.Name != nil {
		if err := s.renameVM(ctx, vm, *in.Name); err != nil {
			return fail(err)
		}
	}
	stopFirst := in.PowerState != nil && *in.PowerState == api.PowerStopped
	if stopFirst {
		if err := s.setPower(ctx, vm, *in.PowerState); err != nil {
			return fail(err)
		}
	}
	if in.VCPUs != nil || in.MemoryMiB != nil {
		if vm, err = s.store.GetVM(ctx, id); err != nil {
			return fail(fromStore(err, "read vm "+id))
		}
		want := store.Shape{VCPUs: vm.Resources.VCPUs, MemoryMiB: vm.Resources.MemoryMiB}
		if in.VCPUs != nil {
			want.VCPUs = *in.VCPUs
		}
		if in.MemoryMiB != nil {
			want.MemoryMiB = *in.MemoryMiB
		}
		if err := s.resizeVM(ctx, vm, want); err != nil {
			return fail(err)
		}
	}
	if disk != nil {
		g := disk
		disk = nil // growDisk gives it back itself on failure
		if err := s.growDisk(ctx, g); err != nil {
			return api.VM{}, err
		}
	}
	if in.PowerState != nil && !stopFirst {
		if vm, err = s.store.GetVM(ctx, id); err != nil {
			return api.VM{}, fromStore(err, "read vm "+id)
		}
		if err := s.setPower(ctx, vm, *in.PowerState); err != nil {
			return api.VM{}, err
		}
	}
	if in.Labels != nil {
		if err := s.store.SetVMLabels(ctx, id, *in.Labels); err != nil {
			return api.VM{}, fromStore(err, "update labels of vm "+id)
		}
	}
	if in.Constraints != nil {
		// Stored, never acted on: the VM stays where it is and keeps the
		// group slot it was placed with (see store.VM.Group).
		if err := s.store.SetVMConstraints(ctx, id, constraintsText(in.Constraints)); err != nil {
			return api.VM{}, fromStore(err, "update constraints of vm "+id)
		}
	}
	return s.GetVM(ctx, id)
}

func (s *Service) setPower(ctx context.Context, vm store.VM, want string) error {
	if api.Gone(vm.ObservedState) {
		return conflictf("VM %s is %s on host %s; delete it and create it again", vm.ID, vm.ObservedState, vm.HostName)
	}
	if observedPower(vm.ObservedState) == want {
		if vm.PowerState == want {
			return nil
		}
		return fromStore(s.store.SetVMPower(ctx, vm.ID, want, vm.ObservedState, vm.Reason), "record power state of vm "+vm.ID)
	}
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return unavailable(nil, "host %s of VM %s does not answer; retry when it is back", vm.HostName, vm.ID)
	}
	action := agentapi.ActionStart
	if want == api.PowerStopped {
		action = agentapi.ActionStop
	}
	got, err := s.agents.action(ctx, s.agents.client(address), vm.ID, action)
	if err != nil {
		return fromAgent(err, vm.HostName, fmt.Sprintf("%s VM %s", action, vm.ID))
	}
	return fromStore(s.store.SetVMPower(ctx, vm.ID, want, got.State, got.Reason), "record power state of vm "+vm.ID)
}

// DeleteVM deletes a VM on its agent, then releases its capacity and
// removes the row in one transaction. Capacity is never released while the
// VM may still run: if its host does not answer, the delete fails.
func (s *Service) DeleteVM(ctx context.Context, id string) error {
	ctx, cancel := detached(ctx, createTimeout)
	defer cancel()
	step := time.Now()
	vm, err := s.visibleVM(ctx, id)
	if err != nil {
		return fromStore(err, "read vm "+id)
	}
	if m, err := s.store.GetMigration(ctx, id); err == nil {
		return conflictf("VM %s is being migrated from %s to %s (%s); delete it once the migration has finished", id, m.SourceHost, m.TargetHost, m.State)
	}
	step = timing.Since(ctx, "read", step)
	address, alive, _ := s.view.agent(vm.HostName)
	// A VM its agent reported missing, or lost with its retired host,
	// holds no capacity and runs nowhere.
	if !api.Gone(vm.ObservedState) || alive {
		if !alive {
			return unavailable(nil, "host %s does not answer, and VM %s may still run there, so it is kept with its capacity reserved; retry when the host is back", vm.HostName, id)
		}
		err := s.agents.deleteVM(ctx, s.agents.client(address), id)
		if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
			return fromAgent(err, vm.HostName, "delete VM "+id)
		}
		step = timing.Since(ctx, "agent", step)
	}
	if err := s.forgetVM(ctx, id, vm.HostName); err != nil {
		return internal(err, "release capacity of vm "+id)
	}
	timing.Since(ctx, "release", step)
	s.log.Info("vm deleted", "vm", id, "name", vm.Name, "host", vm.HostName)
	return nil
}

// observedPower maps an observed state to the power state it amounts to.
func observedPower(state string) string {
	switch state {
	case api.StateRunning:
		return api.PowerRunning
	case api.StateStopped:
		return api.PowerStopped
	}
	return ""
}

// apiVMs converts VMs for the wire with their hosts' liveness as the
// database has it now (not this replica's view, which may lag a round).
func (s *Service) apiVMs(ctx context.Context, vms []store.VM) ([]api.VM, error) {
	var names []string
	for _, vm := range vms {
		if !slices.Contains(names, vm.HostName) {
			names = append(names, vm.HostName)
		}
	}
	alive, err := s.store.HostsAlive(ctx, names)
	if err != nil {
		return nil, fromStore(err, "read vms")
	}
	ids := make([]string, len(vms))
	for i, vm := range vms {
		ids[i] = vm.ID
	}
	atts, err := s.store.AttachmentsOfVMs(ctx, ids)
	if err != nil {
		return nil, fromStore(err, "read vms")
	}
	out := make([]api.VM, 0, len(vms))
	for _, vm := range vms {
		for _, a := range atts[vm.ID] {
			vm.Volumes = append(vm.Volumes, store.VMVolume{VolumeID: a.VolumeID, ReadOnly: a.ReadOnly, State: a.State})
		}
		out = append(out, s.withConstraints(apiVM(vm, alive[vm.HostName]), vm))
	}
	s.vmMigrations(ctx, out)
	return out, nil
}

// apiVM is the wire form of a VM. power_state reports the agent's view
// when it is running or stopped, so that a VM stopped behind Terraform's
// back shows as drift; observed_state is unknown while its host is dead.
func apiVM(vm store.VM, hostAlive bool) api.VM {
	out := api.VM{
		Project: vm.Project,
		ID:      vm.ID, Name: vm.Name, Image: vm.Image, VCPUs: vm.Resources.VCPUs, MemoryMiB: vm.Resources.MemoryMiB,
		DiskMiB: vm.Resources.DiskMiB, Host: vm.HostName, PowerState: vm.PowerState, ObservedState: vm.ObservedState,
		Reason: vm.Reason, StartedFrom: vm.StartedFrom, Labels: vm.Labels, CreatedAt: vm.CreatedAt,
		NetworkInterfaces: apiNICs(vm.NICs), Volumes: apiVMVolumes(vm.Volumes, nil), SecureBoot: vm.SecureBoot,
	}
	withGuest(&out, vm.Guest)
	out.GuestAgent = vm.GuestAgent
	if len(out.NetworkInterfaces) > 0 {
		out.IPv4Address = out.NetworkInterfaces[0].IPv4Address
	}
	if p := observedPower(vm.ObservedState); p != "" {
		out.PowerState = p
	}
	if vm.ForkID != nil {
		out.ForkID = *vm.ForkID
	}
	if p, ok := vm.Pending(); ok {
		out.PendingResize = &api.VMShape{VCPUs: p.VCPUs, MemoryMiB: p.MemoryMiB}
	}
	if out.Labels == nil {
		out.Labels = map[string]string{}
	}
	if !hostAlive && !api.Gone(vm.ObservedState) {
		out.ObservedState = api.StateUnknown
	}
	if vm.Placement != "" {
		var p api.Placement
		if json.Unmarshal([]byte(vm.Placement), &p) == nil {
			out.Placement = &p
		}
	}
	return out
}

// withConstraints adds the VM's constraints and, from this replica's view
// of its host's labels, whether the host still meets them.
func (s *Service) withConstraints(out api.VM, vm store.VM) api.VM {
	out.Constraints = parseConstraints(vm.Constraints)
	if out.Constraints == nil {
		return out
	}
	if h, ok := s.view.get(vm.HostName); ok {
		out.ConstraintsViolated = constraintsViolated(out.Constraints, vm.HostName, h.Labels)
	}
	return out
}

func newID() string {
	id, err := uuid.NewV7()
	if err != nil {
		return uuid.NewString()
	}
	return id.String()
}
