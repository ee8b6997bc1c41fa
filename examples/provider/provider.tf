terraform {
  required_providers {
    kvm = {
      source = "kvmfleet/kvm"
    }
  }
}

# Every setting may be left out: endpoint, token and project then come from
# the KVM_ENDPOINT, KVM_TOKEN and KVM_PROJECT environment variables.
provider "kvm" {
  endpoint        = "http://127.0.0.1:8470"
  token           = var.kvm_token
  request_timeout = "2m"
  max_retries     = 4
  # The project new VMs and networks go to. Left out: the token's project
  # ("default" for a fleet-wide token). A project token may name only its own.
  # project = "team-a"
  # For an https:// endpoint whose certificate a private CA signed:
  # ca_file = "/etc/kvmd/ca.pem"
}

variable "kvm_token" {
  description = "Bearer token of the control API (kvmd control --token)."
  type        = string
  sensitive   = true
}
