package control

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// coldGuestNote is the placement note of a create with guest configuration:
// the warm pool's VMs booted before their seed could exist.
const coldGuestNote = "cold: guest configuration needs its own seed at first boot"

var (
	hostnameLabel   = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)
	metaKeyPattern  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$`)
	notHostnameChar = regexp.MustCompile(`[^a-z0-9-]+`)
)

// hasGuestConfig says whether a create asks for a seed.
func hasGuestConfig(in api.VMCreate) bool {
	return in.UserData != "" || len(in.SSHAuthorizedKeys) > 0 || len(in.MetaData) > 0 || in.NetworkConfig != ""
}

// validateGuest checks a create's guest configuration: sizes, keys, the
// meta-data keys the product sets itself, and the syntax of network_config.
func validateGuest(in api.VMCreate) error {
	if n := len(in.UserData); n > api.MaxUserDataBytes {
		return invalidf("user_data is %d bytes; the limit is %d bytes (64 KiB): keep large files out of user data (fetch them from the guest instead)", n, api.MaxUserDataBytes)
	}
	if n := len(in.SSHAuthorizedKeys); n > api.MaxSSHAuthorizedKeys {
		return invalidf("ssh_authorized_keys has %d keys; at most %d are allowed", n, api.MaxSSHAuthorizedKeys)
	}
	for i, k := range in.SSHAuthorizedKeys {
		if err := validateAuthorizedKey(k); err != nil {
			return invalidf("ssh_authorized_keys[%d] is not an OpenSSH public key: %s; want one line such as \"ssh-ed25519 AAAAC3Nz... user@host\"", i, err)
		}
	}
	if n := len(in.MetaData); n > api.MaxMetaDataKeys {
		return invalidf("meta_data has %d keys; at most %d are allowed", n, api.MaxMetaDataKeys)
	}
	for _, k := range slices.Sorted(maps.Keys(in.MetaData)) {
		v := in.MetaData[k]
		switch k {
		case api.MetaInstanceID:
			return invalidf("meta_data may not set %q: the product sets it (the instance-id is the VM id, so a fork child is a new instance)", k)
		case api.MetaPublicKeys:
			return invalidf("meta_data may not set %q: the product sets it from ssh_authorized_keys; give the keys there", k)
		case api.MetaLocalHostname:
			if err := validateHostname(v); err != nil {
				return invalidf("meta_data[%q]: %s", k, err)
			}
		}
		if !metaKeyPattern.MatchString(k) {
			return invalidf("meta_data key %q is not valid: use 1-255 letters, digits, '.', '_' or '-', starting with a letter or digit", k)
		}
		if len(v) > api.MaxMetaDataValueBytes {
			return invalidf("meta_data[%q] is %d bytes; the limit is %d bytes", k, len(v), api.MaxMetaDataValueBytes)
		}
	}
	if n := len(in.NetworkConfig); n > api.MaxNetworkConfigBytes {
		return invalidf("network_config is %d bytes; the limit is %d bytes (64 KiB)", n, api.MaxNetworkConfigBytes)
	}
	if in.NetworkConfig != "" {
		if err := validateNetworkConfig(in.NetworkConfig); err != nil {
			return invalidf("network_config is not a cloud-init network configuration: %s", err)
		}
	}
	return nil
}

func validateAuthorizedKey(k string) error {
	line := strings.TrimSpace(k)
	if line == "" {
		return fmt.Errorf("it is empty")
	}
	if strings.ContainsAny(line, "\r\n") {
		return fmt.Errorf("it spans several lines; give one key per list element")
	}
	if _, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line)); err != nil {
		return err
	}
	return nil
}

func validateHostname(h string) error {
	if h == "" || len(h) > 253 {
		return fmt.Errorf("hostname %q must be 1 to 253 characters", h)
	}
	for l := range strings.SplitSeq(h, ".") {
		if !hostnameLabel.MatchString(l) {
			return fmt.Errorf("hostname %q is not valid: dot-separated labels of 1-63 letters, digits or '-', not starting or ending with '-'", h)
		}
	}
	return nil
}

// validateNetworkConfig checks that s is YAML (JSON is YAML too) holding a
// mapping with a version (v1 or v2) or a network key, what cloud-init reads.
func validateNetworkConfig(s string) error {
	var doc map[string]any
	if err := yaml.Unmarshal([]byte(s), &doc); err != nil {
		return fmt.Errorf("not a YAML mapping: %v", err)
	}
	if doc == nil {
		return fmt.Errorf("it is empty")
	}
	if _, ok := doc["version"]; ok {
		return nil
	}
	if _, ok := doc["network"]; ok {
		return nil
	}
	return fmt.Errorf("it has neither a top-level \"version\" (1 or 2) nor \"network\" key")
}

// hostnameOf makes a VM name a valid hostname: lower case, runs of other
// characters as '-', at most 63 characters.
func hostnameOf(name string) string {
	h := notHostnameChar.ReplaceAllString(strings.ToLower(name), "-")
	if len(h) > 63 {
		h = h[:63]
	}
	h = strings.Trim(h, "-")
	if h == "" {
		return "vm"
	}
	return h
}

// guestOf is the stored guest configuration of a create; nil without one.
func guestOf(in api.VMCreate) *store.Guest {
	if !hasGuestConfig(in) {
		return nil
	}
	g := &store.Guest{UserData: in.UserData, SSHAuthorizedKeys: trimKeys(in.SSHAuthorizedKeys),
		NetworkConfig: in.NetworkConfig, Hostname: hostnameOf(in.Name)}
	if len(in.MetaData) > 0 {
		g.MetaData = maps.Clone(in.MetaData)
	}
	if h := in.MetaData[api.MetaLocalHostname]; h != "" {
		g.Hostname = h
	}
	return g
}

func trimKeys(keys []string) []string {
	var out []string
	for _, k := range keys {
		out = append(out, strings.TrimSpace(k))
	}
	return out
}

// seedSpec is the agent's seed of a VM with guest configuration g:
// instance-id is the VM's id, the hostname g's. The user's local-hostname
// travels as the Hostname, not among the extra keys.
func seedSpec(vmID string, g *store.Guest) *agentapi.SeedSpec {
	if g == nil {
		return nil
	}
	spec := &agentapi.SeedSpec{InstanceID: vmID, Hostname: g.Hostname, UserData: g.UserData,
		SSHAuthorizedKeys: slices.Clone(g.SSHAuthorizedKeys), NetworkConfig: g.NetworkConfig}
	for k, v := range g.MetaData {
		if k == api.MetaLocalHostname {
			continue
		}
		if spec.MetaData == nil {
			spec.MetaData = map[string]string{}
		}
		spec.MetaData[k] = v
	}
	return spec
}

// childGuest is a fork child's guest configuration: the source's, named
// after the child (its own hostname; its instance-id is its own id).
func childGuest(g *store.Guest, childName string) *store.Guest {
	if g == nil {
		return nil
	}
	c := *g
	c.SSHAuthorizedKeys = slices.Clone(g.SSHAuthorizedKeys)
	c.MetaData = maps.Clone(g.MetaData)
	delete(c.MetaData, api.MetaLocalHostname)
	if len(c.MetaData) == 0 {
		c.MetaData = nil
	}
	c.Hostname = hostnameOf(childName)
	return &c
}

// withGuest fills the wire form's guest fields; the user data itself is
// never returned, only its digest.
func withGuest(out *api.VM, g *store.Guest) {
	out.SSHAuthorizedKeys = []string{}
	out.MetaData = map[string]string{}
	if g == nil {
		return
	}
	if g.UserData != "" {
		sum := sha256.Sum256([]byte(g.UserData))
		out.UserDataSHA256 = hex.EncodeToString(sum[:])
	}
	out.SSHAuthorizedKeys = append(out.SSHAuthorizedKeys, g.SSHAuthorizedKeys...)
	maps.Copy(out.MetaData, g.MetaData)
	out.NetworkConfig = g.NetworkConfig
	out.Hostname = g.Hostname
}

// VMConsole returns the last n bytes of a VM's serial console, from its
// agent.
func (s *Service) VMConsole(ctx context.Context, id string, n int64) (string, error) {
	agent, vm, err := s.agentOfVM(ctx, id)
	if err != nil {
		return "", err
	}
	out, err := s.agents.console(ctx, agent, id, n)
	if err != nil {
		return "", fromAgent(err, vm.HostName, "read the console of VM "+id)
	}
	return out, nil
}

// VMGuest returns what a VM's guest reported during its current boot, as
// its agent reads it from the serial console.
func (s *Service) VMGuest(ctx context.Context, id string) (api.GuestStatus, error) {
	agent, vm, err := s.agentOfVM(ctx, id)
	if err != nil {
		return api.GuestStatus{}, err
	}
	g, err := s.agents.guest(ctx, agent, id)
	if err != nil {
		return api.GuestStatus{}, fromAgent(err, vm.HostName, "read the guest status of VM "+id)
	}
	out := api.GuestStatus{CloudInit: g.CloudInit, CloudInitErrors: g.CloudInitErrors, IPv4Addresses: g.IPv4Addresses,
		Hostname: g.Hostname, UserDataSHA256: g.UserDataSHA256, GuestAgent: g.GuestAgent}
	if out.IPv4Addresses == nil {
		out.IPv4Addresses = []string{}
	}
	if out.CloudInit == "" {
		out.CloudInit = api.CloudInitNone
	}
	if out.GuestAgent == "" {
		out.GuestAgent = api.GuestAgentNone // an agent from before the guest agent
	}
	return out, nil
}

// guestAgentTimeout bounds the agent call of withGuestAgentAddresses: a
// VM read must not wait long for a guest that does not answer.
const guestAgentTimeout = 5 * time.Second

// withGuestAgentAddresses fills the addresses that a running VM's guest
// agent reports on each NIC (NetworkInterface.IPv4Addresses), asking its
// agent; a VM without guest_agent, on a host that does not answer, or
// whose guest agent does not answer gets none, and the read goes on.
func (s *Service) withGuestAgentAddresses(ctx context.Context, vm store.VM, out *api.VM) {
	if !vm.GuestAgent || out.ObservedState != api.StateRunning {
		return
	}
	address, alive, known := s.view.agent(vm.HostName)
	if !known || !alive {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, guestAgentTimeout)
	defer cancel()
	got, err := s.agents.getVM(ctx, s.agents.client(address), vm.ID)
	if err != nil {
		s.log.Debug("read the guest agent's addresses", "vm", vm.ID, "host", vm.HostName, "err", err)
		return
	}
	for i := range out.NetworkInterfaces {
		if i < len(got.NICs) && len(got.NICs[i].IPv4Addresses) > 0 {
			out.NetworkInterfaces[i].IPv4Addresses = slices.Clone(got.NICs[i].IPv4Addresses)
		}
	}
}

// agentOfVM returns the client of the agent that runs VM id; unavailable
// when that host does not answer.
func (s *Service) agentOfVM(ctx context.Context, id string) (*agentapi.Client, store.VM, error) {
	vm, err := s.visibleVM(ctx, id)
	if err != nil {
		return nil, store.VM{}, fromStore(err, "read vm "+id)
	}
	address, alive, known := s.view.agent(vm.HostName)
	if !known || !alive {
		return nil, vm, unavailable(nil, "host %s of VM %s does not answer; retry when it is back", vm.HostName, id)
	}
	return s.agents.client(address), vm, nil
}

// guestNote is the placement note of a create with guest configuration
// ("" for other VMs and for fork children, which start from a snapshot).
func guestNote(vm store.VM) string {
	if vm.Guest == nil || vm.ForkID != nil {
		return ""
	}
	return coldGuestNote
}
