# Register a host agent (kvmd agent --listen 10.0.0.11:8471) with the control API.
resource "kvm_host" "node1" {
  name    = "node1"
  address = "10.0.0.11:8471"
  labels = {
    rack = "r1"
  }
  cpu_allocation_ratio = 2.0
  memory_reserved_mib  = 2048
}

# A host kept out of new placements while its VMs keep running.
resource "kvm_host" "node2" {
  name        = "node2"
  address     = "10.0.0.12:8471"
  schedulable = false
}
