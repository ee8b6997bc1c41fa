# Look a VM up by name (or by id, with id = "...").
data "kvm_vm" "web" {
  name = "web-1"
}

output "web_host" {
  value = data.kvm_vm.web.host
}
