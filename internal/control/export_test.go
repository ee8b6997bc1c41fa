package control

import "github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"

// ViewHost is a host as this replica's host view has it (for tests).
func (s *Service) ViewHost(name string) (scheduler.Host, bool) { return s.view.get(name) }

// ViewAgentAddress is a host's agent address in the host view (for tests).
func (s *Service) ViewAgentAddress(name string) string {
	addr, _, _ := s.view.agent(name)
	return addr
}
