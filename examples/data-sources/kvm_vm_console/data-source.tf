# The end of a VM's serial console: boot messages and cloud-init's progress.
data "kvm_vm_console" "app" {
  vm_id = kvm_vm.app.id
  bytes = 8192
}

output "app_console" {
  value = data.kvm_vm_console.app.output
}
