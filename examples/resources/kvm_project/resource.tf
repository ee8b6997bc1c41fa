# A team's share of the fleet (managed with an admin token): at most 16
# vCPUs, 32 GiB of memory and 10 VMs at once, on hosts labelled pool=team.
# The disk quota is left out, so disk is unlimited.
resource "kvm_project" "team_a" {
  name        = "team-a"
  description = "Team A's build runners"
  quotas = {
    vcpus      = 16
    memory_mib = 32768
    vms        = 10
  }
  host_labels = { pool = "team" }
}

# A project without limits.
resource "kvm_project" "sandbox" {
  name = "sandbox"
}

output "team_a_vcpus_left" {
  value = kvm_project.team_a.quotas.vcpus - kvm_project.team_a.usage.vcpus
}
