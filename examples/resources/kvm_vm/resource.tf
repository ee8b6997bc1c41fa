# The control API places the VM on the best host and boots it. A later change
# of vcpus or memory_mib resizes it in place (the guest restarts, its disk
# stays); a change of name renames it in place.
resource "kvm_vm" "web" {
  name       = "web-1"
  image      = "busybox"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 2048
  labels = {
    role = "web"
  }

  timeouts {
    create = "15m"
  }
}

# Pinned to one host and kept stopped; power_state and labels change in place.
resource "kvm_vm" "batch" {
  name        = "batch-1"
  image       = "busybox"
  vcpus       = 1
  memory_mib  = 256
  disk_mib    = 1024
  host        = "node1"
  power_state = "stopped"
}

output "web_placement" {
  value = kvm_vm.web.placement_summary
}
