# Register a host agent with the control API. The agent serves TLS off loopback:
#   kvmd agent --listen 10.0.0.11:8471 --tls-cert agent.crt --tls-key agent.key --token-file agent.token
# It proves its identity before the control plane sends it the agent token.
resource "kvm_host" "node1" {
  name    = "node1"
  address = "https://10.0.0.11:8471"
  labels = {
    rack = "r1"
  }
  cpu_allocation_ratio = 2.0
  memory_reserved_mib  = 2048

  # Where overlay networks' VXLAN tunnels run from (kvmd agent
  # --underlay-address 10.0.0.11): allow UDP 4789 between the hosts'
  # underlay addresses.
  underlay_address = "10.0.0.11"

  # Keep two paused, pre-booted busybox VMs of this shape ready: a kvm_vm of
  # exactly this image, vcpus, memory_mib and disk_mib starts from one in
  # milliseconds (its started_from is "warm"); the agent boots a replacement.
  warm_pool = [{
    image      = "busybox"
    vcpus      = 1
    memory_mib = 128
    disk_mib   = 64
    size       = 2
  }]
}

# A host kept out of new placements while its VMs keep running.
resource "kvm_host" "node2" {
  name        = "node2"
  address     = "https://10.0.0.12:8471"
  schedulable = false
}

# A host being patched: drain = true keeps new VMs off it and migrates every
# VM placed there to other hosts (live while they run), each under its own
# constraints. The apply waits until the host is drained; drain_status shows
# the progress and any VM that could not move. The kvm_vm resources of the
# moved VMs show no change. Set drain = false once the host is back.
resource "kvm_host" "node3" {
  name    = "node3"
  address = "https://10.0.0.13:8471"
  drain   = true
}
