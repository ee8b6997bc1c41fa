package control

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"regexp"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/limits"
)

// Limits of one VM: the agents' (internal/limits), so that nothing the
// control API reserves capacity for is refused by an agent for its size.
const (
	MaxVCPUs     = limits.MaxVCPUs
	MaxMemoryMiB = limits.MaxMemoryMiB
	MaxDiskMiB   = limits.MaxDiskMiB
	maxLabels    = 64
	maxImageLen  = 128
)

var (
	namePattern     = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)
	labelKeyPattern = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$`)
	imagePattern    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]*$`)
)

func validateName(what, name string) error {
	if name == "" {
		return invalidf("%s is required", what)
	}
	if !namePattern.MatchString(name) {
		return invalidf("%s %q is not valid: use 1-63 letters, digits, '.', '_' or '-', starting and ending with a letter or digit", what, name)
	}
	return nil
}

func validateSize(field string, v, maxV int64, unit string) error {
	if v <= 0 || v > maxV {
		return invalidf("%s must be between 1 and %d%s, got %d", field, maxV, unit, v)
	}
	return nil
}

func validateShape(image string, vcpus, memoryMiB, diskMiB int64) error {
	if image == "" {
		return invalidf("image is required")
	}
	if len(image) > maxImageLen || !imagePattern.MatchString(image) {
		return invalidf("image %q is not a valid image name", image)
	}
	if err := validateSize("vcpus", vcpus, MaxVCPUs, ""); err != nil {
		return err
	}
	if err := validateSize("memory_mib", memoryMiB, MaxMemoryMiB, " MiB"); err != nil {
		return err
	}
	return validateSize("disk_mib", diskMiB, MaxDiskMiB, " MiB")
}

func validateLabels(labels map[string]string) error {
	if len(labels) > maxLabels {
		return invalidf("at most %d labels, got %d", maxLabels, len(labels))
	}
	for k, v := range labels {
		if !labelKeyPattern.MatchString(k) {
			return invalidf("label key %q is not valid: use 1-63 letters, digits, '.', '_', '/' or '-'", k)
		}
		if len(v) > 255 {
			return invalidf("label %q: value longer than 255 characters", k)
		}
	}
	return nil
}

func validatePowerState(p string) error {
	switch p {
	case api.PowerRunning, api.PowerStopped:
		return nil
	}
	return invalidf("power_state must be %q or %q, got %q", api.PowerRunning, api.PowerStopped, p)
}

func validateVMPatch(in api.VMPatch) error {
	if in.Name != nil {
		if err := validateName("name", *in.Name); err != nil {
			return err
		}
	}
	if in.VCPUs != nil {
		if err := validateSize("vcpus", *in.VCPUs, MaxVCPUs, ""); err != nil {
			return err
		}
	}
	if in.MemoryMiB != nil {
		if err := validateSize("memory_mib", *in.MemoryMiB, MaxMemoryMiB, " MiB"); err != nil {
			return err
		}
	}
	if in.PowerState != nil {
		if err := validatePowerState(*in.PowerState); err != nil {
			return err
		}
	}
	if in.Labels != nil {
		return validateLabels(*in.Labels)
	}
	return nil
}

func validateVMCreate(in api.VMCreate) error {
	if err := validateName("name", in.Name); err != nil {
		return err
	}
	if err := validateShape(in.Image, in.VCPUs, in.MemoryMiB, in.DiskMiB); err != nil {
		return err
	}
	if in.Host != "" {
		if err := validateName("host", in.Host); err != nil {
			return err
		}
	}
	if in.PowerState != "" {
		if err := validatePowerState(in.PowerState); err != nil {
			return err
		}
	}
	if err := validateLabels(in.Labels); err != nil {
		return err
	}
	if err := validateGuest(in); err != nil {
		return err
	}
	return validateConstraints(in.Constraints)
}

func validateHostPut(name string, in api.HostPut) error {
	if err := validateName("host name", name); err != nil {
		return err
	}
	if err := validateAddress(in.Address); err != nil {
		return err
	}
	if u := in.UnderlayAddress; u != "" {
		ip, err := netip.ParseAddr(u)
		if err != nil || !ip.Is4() || ip.String() != u {
			return &Error{Code: api.CodeInvalid, Details: map[string]any{"field": "underlay_address"},
				Message: fmt.Sprintf("underlay_address %q is not an IPv4 address such as 192.168.10.11 (the host's address that overlay tunnels run between)", u)}
		}
		if ip.IsLoopback() || ip.IsUnspecified() || ip.IsMulticast() {
			return &Error{Code: api.CodeInvalid, Details: map[string]any{"field": "underlay_address"},
				Message: fmt.Sprintf("underlay_address %s is not a unicast address other hosts can reach; give the address of the host's interface on the network between hosts", u)}
		}
	}
	if r := in.CPUAllocationRatio; r != nil && (*r <= 0 || *r > 64) {
		return invalidf("cpu_allocation_ratio must be above 0 and at most 64, got %v", *r)
	}
	if m := in.MemoryReservedMiB; m != nil && (*m < 0 || *m > MaxMemoryMiB) {
		return invalidf("memory_reserved_mib must be between 0 and %d, got %d", MaxMemoryMiB, *m)
	}
	for i, p := range in.WarmPool {
		if err := validateShape(p.Image, p.VCPUs, p.MemoryMiB, p.DiskMiB); err != nil {
			var e *Error
			if errors.As(err, &e) {
				return invalidf("warm_pool[%d]: %s", i, e.Message)
			}
			return err
		}
		if p.Size < 0 || p.Size > 1000 {
			return invalidf("warm_pool[%d]: size must be between 0 and 1000, got %d", i, p.Size)
		}
	}
	if err := validateWarmPool(in.WarmPool); err != nil {
		return err
	}
	return validateLabels(in.Labels)
}

// validateAddress accepts scheme://host:port (http or https) and nothing
// else: no user info, path, query or fragment, which would change what
// the control plane's calls to the agent reach.
func validateAddress(addr string) error {
	if addr == "" {
		return invalidf("address is required: the agent's https://host:port (http:// on loopback)")
	}
	canonical, err := agentapi.CheckAddress(addr)
	if err != nil {
		return invalidf("%v: give the agent's address as https://host:port (http:// on loopback), e.g. https://kvm-01.example.net:8471", err)
	}
	if canonical != addr {
		return invalidf("address %q: write it as %q (lower case, no trailing slash)", addr, canonical)
	}
	return nil
}

// plainHTTPOffLoopback says whether a valid agent address is http:// to a
// host other than a loopback address (127.0.0.0/8, ::1, localhost): the
// agent token, user data and image tokens would cross a network in clear.
func plainHTTPOffLoopback(addr string) bool {
	u, err := url.Parse(addr)
	if err != nil || u.Scheme != "http" {
		return false
	}
	host := u.Hostname()
	if host == "localhost" {
		return false
	}
	ip, err := netip.ParseAddr(host)
	return err != nil || !ip.IsLoopback()
}

// checkAgentTransport refuses an http:// agent address off loopback unless
// the control plane runs with --allow-insecure-agents.
func (s *Service) checkAgentTransport(name, addr string) error {
	if s.opts.AllowInsecureAgents || !plainHTTPOffLoopback(addr) {
		return nil
	}
	return &Error{Code: api.CodeInvalid, Details: map[string]any{"host": name, "address": addr},
		Message: fmt.Sprintf("register host %s: the address %s is plain http:// off loopback, where the agent token and the VMs' "+
			"user data would cross the network in clear; serve the agent over TLS (kvmd agent --tls-cert, --tls-key) and register "+
			"it as https://, or start kvmd control with --allow-insecure-agents (KVMD_ALLOW_INSECURE_AGENTS=true) on a network you trust",
			name, addr)}
}

// parseLabelFilter splits "key=value".
func parseLabelFilter(s string) (string, string, error) {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return "", "", invalidf("label filter %q must be key=value", s)
	}
	return k, v, nil
}

func describeShape(image string, r api.Resources) string {
	return fmt.Sprintf("%d vCPUs, %d MiB memory, %d MiB disk of image %q", r.VCPUs, r.MemoryMiB, r.DiskMiB, image)
}
