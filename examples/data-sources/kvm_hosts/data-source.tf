# Every registered host.
data "kvm_hosts" "all" {}

# Only the hosts labelled rack = "r1".
data "kvm_hosts" "rack1" {
  labels = {
    rack = "r1"
  }
}

output "alive_hosts" {
  value = [for h in data.kvm_hosts.all.hosts : h.name if h.alive]
}
