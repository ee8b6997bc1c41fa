# Live migration and drain: patch node1 without touching a VM resource.
#
# 1. The VMs are placed by the scheduler (no host pinned), so wherever a
#    migration takes them, their plan stays empty.
# 2. Set drain = true on node1 and apply: node1 takes no new VM and every
#    VM on it moves to node2 or node3, keeping the group's cap of one VM
#    per host. Reboot node1, then set drain = false and apply again.
# 3. api-0 pins its host: changing it moves the VM there in place (an
#    update, not a replace; the id stays).

resource "kvm_host" "node1" {
  name    = "node1"
  address = "https://10.0.0.11:8471"
  drain   = false
}

resource "kvm_host" "node2" {
  name    = "node2"
  address = "https://10.0.0.12:8471"
}

resource "kvm_host" "node3" {
  name    = "node3"
  address = "https://10.0.0.13:8471"
}

resource "kvm_vm" "db" {
  count      = 2
  name       = "db-${count.index}"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 64

  constraints {
    group          = "db"
    max_per_domain = 1
  }

  depends_on = [kvm_host.node1, kvm_host.node2, kvm_host.node3]
}

resource "kvm_vm" "api" {
  name       = "api-0"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
  host       = kvm_host.node2.name
}

output "drain" {
  value = kvm_host.node1.drain_status
}
