# A private network that each host's agent makes: a bridge, a tap per NIC,
# DHCP with one static lease per MAC and masquerade for traffic out. The
# control plane assigns each VM an address from the cidr. Its guests reach
# each other and the outside, not their host nor other networks.
resource "kvm_network" "lan" {
  name = "lan"
  mode = "nat"
  cidr = "10.20.0.0/24"
  # gateway defaults to the first usable address (10.20.0.1).
}

# A nat network whose guests may also open connections to lan's guests and
# to the office LAN (private ranges are fenced off unless listed).
resource "kvm_network" "app" {
  name  = "app"
  mode  = "nat"
  cidr  = "10.21.0.0/24"
  allow = [kvm_network.lan.name, "192.168.50.0/24"]
}

# An existing bridge of some hosts; VMs on it are placed on those hosts only.
resource "kvm_network" "office" {
  name   = "office"
  mode   = "bridge"
  bridge = "br0"
  cidr   = "192.168.50.0/24"
  hosts  = ["node1", "node2"]
}

# One private network across the hosts: a VXLAN tunnel (UDP 4789) between
# the hosts' underlay addresses (kvm_host.underlay_address) joins each
# host's bridge, so its VMs reach each other whatever host they run on.
resource "kvm_network" "backend" {
  name = "backend"
  mode = "overlay"
  cidr = "10.40.0.0/24"
  # vni defaults to the lowest free from 4096 up, mtu to 1450 (a
  # 1500-byte underlay less the VXLAN overhead).
}

# A VM with an address on lan, and a user-mode NIC whose guest port 80 is
# reachable on 127.0.0.1 of its host.
resource "kvm_vm" "web" {
  name       = "web-1"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 1024

  network_interface {
    network = kvm_network.lan.name
  }
  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }
}

output "web_address" {
  value = kvm_vm.web.ipv4_address
}

output "web_http" {
  value = "http://${kvm_vm.web.network_interface[1].port_forward[0].host_address}:${kvm_vm.web.network_interface[1].port_forward[0].host_port}/"
}
