package provider

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/diag"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// The diagnostic wording of the provider, kept in one place. A summary names
// the failed operation; a detail says which object, what to do next, and
// then the original error.
const (
	summaryUnknownSetting     = "Unknown KVM Provider Setting"
	summaryUnexpectedData     = "Unexpected Provider Data"
	summaryCreateVM           = "Unable to Create VM"
	summaryReadVM             = "Unable to Read VM"
	summaryPlanVM             = "Unable to Plan VM"
	summaryUpdateVM           = "Unable to Update VM"
	summaryDeleteVM           = "Unable to Delete VM"
	summaryImportVM           = "Unable to Import VM"
	summaryCreateHost         = "Unable to Register Host"
	summaryReadHost           = "Unable to Read Host"
	summaryUpdateHost         = "Unable to Update Host"
	summaryDeleteHost         = "Unable to Deregister Host"
	summaryReadHosts          = "Unable to List Hosts"
	summaryPlacement          = "Unable to Plan Placement"
	summaryTimeouts           = "Invalid Timeouts"
	summaryVMFailed           = "VM Failed to Reach Its Power State"
	summaryHostAlreadyExists  = "Host Already Registered"
	summaryVMNameAlreadyTaken = "VM Name Already Taken"
	summaryCreateFork         = "Unable to Create Fork"
	summaryReadFork           = "Unable to Read Fork"
	summaryUpdateFork         = "Unable to Update Fork"
	summaryDeleteFork         = "Unable to Delete Fork"
	summaryImportFork         = "Unable to Import Fork"
	summaryForkFailed         = "Fork Failed to Become Ready"
	summaryForkPointTaken     = "Fork Point Already Taken"
	summaryCreateNetwork      = "Unable to Create Network"
	summaryReadNetwork        = "Unable to Read Network"
	summaryUpdateNetwork      = "Unable to Update Network"
	summaryDeleteNetwork      = "Unable to Delete Network"
	summaryAddressTaken       = "IPv4 Address Already Taken"
	summaryConstraintsStored  = "Constraints Change Moves Nothing"
	summaryCreateImage        = "Unable to Register Image"
	summaryReadImage          = "Unable to Read Image"
	summaryUpdateImage        = "Unable to Update Image"
	summaryDeleteImage        = "Unable to Delete Image"
	summaryImageAlreadyExists = "Image Already Registered"
	summaryInvalidWait        = "Invalid Wait"
	summaryGuestNotReady      = "VM Guest Not Ready"
	summaryReadConsole        = "Unable to Read VM Console"
	summaryCreateProject      = "Unable to Create Project"
	summaryReadProject        = "Unable to Read Project"
	summaryUpdateProject      = "Unable to Update Project"
	summaryDeleteProject      = "Unable to Delete Project"
	summaryProjectExists      = "Project Already Exists"
	summaryCreateVolume       = "Unable to Create Volume"
	summaryReadVolume         = "Unable to Read Volume"
	summaryUpdateVolume       = "Unable to Update Volume"
	summaryDeleteVolume       = "Unable to Delete Volume"
	summaryVolumeShrink       = "Volume Cannot Shrink"
	summaryVolumeMoveAttached = "Attached Volume Cannot Move"
	summaryMoveVolume         = "Unable to Move Volume"
)

// addAPIError adds an error diagnostic for a failed control API call:
// subject says what was being done to which object ("creating VM \"web-1\"").
func addAPIError(diags *diag.Diagnostics, summary, subject string, err error) {
	diags.AddError(summary, apiErrorDetail(subject, err))
}

// addDeleteError reports the outcome of deleting an object kept by name
// (host, network, image): gone already (404) is done; 409 says what still
// holds it and what to do (inUse); anything else is the API's error.
func addDeleteError(diags *diag.Diagnostics, summary, subject string, err error, inUse string) {
	switch {
	case err == nil, errors.Is(err, client.ErrNotFound):
	case errors.Is(err, client.ErrConflict):
		diags.AddError(summary, inUse+"\n\nError: "+err.Error())
	default:
		addAPIError(diags, summary, subject, err)
	}
}

func apiErrorDetail(subject string, err error) string {
	return fmt.Sprintf("The control API failed %s. %s\n\nError: %s", subject, nextStep(err), err)
}

// nextStep tells the operator what to do about an error of the client.
func nextStep(err error) string {
	switch {
	case errors.Is(err, client.ErrUnauthorized):
		return "It rejected the token: check the provider's \"token\" (or KVM_TOKEN): it may be mistyped, revoked or expired."
	case errors.Is(err, client.ErrForbidden):
		return "The token is valid but its scopes do not allow this: VMs, forks, placements and volumes need scope \"user\"; " +
			"hosts, networks, images, projects and tokens need scope \"admin\", which a project token never holds (kvmd token create --scopes ...)."
	case errors.Is(err, client.ErrNoCapacity):
		return "No host can take it: free capacity, register another host (kvm_host), or choose a smaller shape." +
			rejectionLines(err)
	case errors.Is(err, client.ErrQuotaExceeded):
		return quotaStep(err)
	case errors.Is(err, client.ErrNoAddress):
		return "The network has no free address left: delete VMs on it, or put the VM on a larger network."
	case errors.Is(err, client.ErrIdempotencyMismatch):
		return "A retry carried a different body under the same Idempotency-Key; run terraform apply again."
	case errors.Is(err, client.ErrInFlight):
		return "The same request is still running on the control API; wait a moment and run terraform apply again."
	case errors.Is(err, client.ErrUnavailable):
		return "The control API did not answer successfully after the configured retries: check that kvmd control " +
			"is running and reachable at the provider's \"endpoint\", then run terraform apply again."
	case errors.Is(err, client.ErrNotFound):
		return "The object does not exist on the control API."
	case errors.Is(err, client.ErrUnexpectedAnswer):
		return "The endpoint answered 404 without the control API's own not_found error, so the object is kept in state: " +
			"check the provider's \"endpoint\" (a path prefix, or a proxy in front of kvmd control that does not forward /v1)."
	case errors.Is(err, client.ErrConflict):
		return "It conflicts with the current state of the fleet; see the error below."
	case errors.Is(err, client.ErrInvalid):
		return "It rejected the request as invalid: fix the configuration as the error below says."
	default:
		return "Check the error below, then run terraform apply again."
	}
}

// quotaStep explains a quota_exceeded answer: which project and quota, the
// numbers, and the ways out.
func quotaStep(err error) string {
	q, _ := client.QuotaExceededOf(err)
	return fmt.Sprintf("It would exceed the %s quota of project %q: the limit is %d, the project holds %d and this "+
		"asks for %d more. Raise quotas.%s of the project (its kvm_project, with an admin token), delete VMs of the "+
		"project, or ask for less, then run terraform apply again.", q.Resource, q.Project, q.Limit, q.Used, q.Requested, q.Resource)
}

// addCreateInProjectError reports a failed create of a VM or network. A
// not_found answer to a create that named a project means the token may
// not use that project (or it does not exist): the provider's project
// setting is what to fix (the provider block's, so the diagnostic points at
// no attribute of the resource).
func addCreateInProjectError(diags *diag.Diagnostics, summary, subject, project string, err error) {
	if project != "" && errors.Is(err, client.ErrNotFound) {
		diags.AddError(summary, fmt.Sprintf("The control API failed %s: it knows no "+
			"project %q that this token may use. Check the provider's \"project\" (or %s): a project token creates only "+
			"in its own project (leave project out to use it), and the project must exist (kvm_project, an admin "+
			"token).\n\nError: %s", subject, project, EnvProject, err))
		return
	}
	addAPIError(diags, summary, subject, err)
}

// rejectionLines lists the per-host reasons a no_capacity answer carries in
// its details, if any.
func rejectionLines(err error) string {
	rej := rejectionsOf(err)
	if len(rej) == 0 {
		return ""
	}
	lines := make([]string, len(rej))
	for i, r := range rej {
		lines[i] = fmt.Sprintf("  - %s: %s", r.Host, r.Reason)
		if r.Detail != "" {
			lines[i] += " (" + r.Detail + ")"
		}
	}
	sort.Strings(lines)
	return "\n\nRejected hosts:\n" + strings.Join(lines, "\n")
}

// conflictingVMID is the id of the VM that already holds a name, when the
// control API says so in a 409's details.
func conflictingVMID(err error) string {
	var ae *client.Error
	if !errors.As(err, &ae) {
		return ""
	}
	for _, k := range []string{"existing_id", "id", "vm_id"} {
		if id, ok := ae.Details[k].(string); ok && id != "" {
			return id
		}
	}
	return ""
}

// addressHolder is the VM that holds a fixed address a create asked for
// ("" when the conflict is not about an address).
func addressHolder(err error) string {
	var ae *client.Error
	if !errors.As(err, &ae) {
		return ""
	}
	id, _ := ae.Details["holder_id"].(string)
	return id
}

// providerDataFrom is the Configure of every resource and data source: the
// provider's shared client, or nil before the provider is configured (the
// framework calls Configure early, during validation, with no data).
func providerDataFrom(data any, diags *diag.Diagnostics) *providerData {
	if data == nil {
		return nil
	}
	pd, ok := data.(*providerData)
	if !ok {
		addUnexpectedDataError(diags, data)
		return nil
	}
	return pd
}

func addUnexpectedDataError(diags *diag.Diagnostics, data any) {
	diags.AddError(summaryUnexpectedData, fmt.Sprintf(
		"Expected *provider.providerData, got %T. This is a bug in the provider; please report it.", data))
}
