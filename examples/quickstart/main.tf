# The quickstart: two VMs on the fleet that `kvmd dev` runs on this machine
# (control API on 127.0.0.1:8470 plus one local agent), the hosts, and a
# placement dry run. `make demo` runs it end to end; by hand:
#
#   kvmd dev --listen 127.0.0.1:8470 --data-dir /tmp/kvmd-dev   # prints its token
#   export KVM_ENDPOINT=http://127.0.0.1:8470 KVM_TOKEN=<that token>
#   terraform apply                  # with the qemu driver
#   terraform apply -var image=sim   # when kvmd dev says it uses the sim driver

terraform {
  required_providers {
    kvm = {
      source = "kvmfleet/kvm"
    }
  }
}

# endpoint and token come from KVM_ENDPOINT and KVM_TOKEN.
provider "kvm" {}

variable "image" {
  description = "Guest image: busybox (qemu driver) or sim (simulated driver)."
  type        = string
  default     = "busybox"
}

variable "vm_count" {
  description = "How many VMs to create."
  type        = number
  default     = 2
}

resource "kvm_vm" "demo" {
  count = var.vm_count

  name       = "demo-${count.index}"
  image      = var.image
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256
  labels = {
    app = "quickstart"
  }

  # One NIC on the user-mode network "default", with the guest's port 80
  # forwarded to a port on 127.0.0.1 of its host that the agent picks.
  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }
}

# Both data sources wait for the VMs, so they show the fleet with them placed.
data "kvm_hosts" "all" {
  depends_on = [kvm_vm.demo]
}

data "kvm_placement" "next" {
  image      = var.image
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256

  depends_on = [kvm_vm.demo]
}

output "vms" {
  description = "The VMs: where each landed and why."
  value = {
    for vm in kvm_vm.demo : vm.name => {
      id             = vm.id
      host           = vm.host
      observed_state = vm.observed_state
      placement      = vm.placement_summary
    }
  }
}

output "http" {
  description = "Each VM's web server, through its forwarded port on the host's 127.0.0.1."
  value = {
    for vm in kvm_vm.demo : vm.name =>
    "http://${vm.network_interface[0].port_forward[0].host_address}:${vm.network_interface[0].port_forward[0].host_port}/"
  }
}

output "hosts" {
  description = "The hosts: driver, accelerator, liveness and what is left."
  value = {
    for h in data.kvm_hosts.all.hosts : h.name => {
      alive  = h.alive
      driver = h.driver
      accel  = h.accel
      images = h.images
      free   = h.free
    }
  }
}

output "placement" {
  description = "Where a third VM of the same shape would go now."
  value = {
    fits     = data.kvm_placement.next.fits
    host     = data.kvm_placement.next.chosen_host
    score    = data.kvm_placement.next.score
    rejected = { for r in data.kvm_placement.next.rejected : r.host => r.reason }
  }
}
