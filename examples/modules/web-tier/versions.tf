terraform {
  # Write-only arguments and the rest of kvm_vm's guest configuration need 1.11.
  required_version = ">= 1.11"

  required_providers {
    kvm = {
      source = "kvmfleet/kvm"
    }
  }
}
