# A running VM to fork.
resource "kvm_vm" "base" {
  name       = "base"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 256
}

# Three children that each resume from the same point of kvm_vm.base. The
# source keeps running; child_count changes in place.
resource "kvm_fork" "workers" {
  source_vm_id = kvm_vm.base.id
  child_count  = 3
  placement    = "colocate"

  timeouts {
    create = "15m"
  }
}

# Three children on three different hosts: the fork's children are a group
# of their own, capped at one per host.
resource "kvm_fork" "replicas" {
  source_vm_id = kvm_vm.base.id
  child_count  = 3
  placement    = "spread"

  constraints {
    spread_by      = "host"
    max_per_domain = 1
  }
}

output "worker_hosts" {
  value = { for c in kvm_fork.workers.children : c.name => c.host }
}
