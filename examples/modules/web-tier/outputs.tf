output "addresses" {
  description = "Each VM's IPv4 address on the tier's network, by VM name."
  value       = { for vm in kvm_vm.web : vm.name => vm.ipv4_address }
}

output "hosts" {
  description = "The host each VM was placed on, by VM name."
  value       = { for vm in kvm_vm.web : vm.name => vm.host }
}

output "vm_ids" {
  description = "Each VM's id, by VM name."
  value       = { for vm in kvm_vm.web : vm.name => vm.id }
}

output "user_data_sha256" {
  description = "SHA-256 of each VM's user data, by VM name (the guest reports the same digest once it read it)."
  value       = { for vm in kvm_vm.web : vm.name => vm.user_data_sha256 }
}

output "network" {
  description = "Name of the tier's network."
  value       = kvm_network.this.name
}

output "image" {
  description = "Name of the image the VMs run."
  value       = local.image
}
