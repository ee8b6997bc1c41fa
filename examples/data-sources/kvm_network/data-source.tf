# The built-in user-mode network, and how many addresses a nat network has left.
data "kvm_network" "default" {
  name = "default"
}

data "kvm_network" "lan" {
  name = "lan"
}

output "lan_free_addresses" {
  value = data.kvm_network.lan.addresses_total - data.kvm_network.lan.addresses_used
}
