# A project's quotas (null: unlimited) and what its VMs hold now. With a
# project token, only the token's own project can be read.
data "kvm_project" "team_a" {
  name = "team-a"
}

output "team_a_quotas" {
  value = data.kvm_project.team_a.quotas
}

output "team_a_usage" {
  value = data.kvm_project.team_a.usage
}
