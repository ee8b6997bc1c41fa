# The quickstart: two VMs on the fleet that `kvmd dev` runs on this machine
# (control API on 127.0.0.1:8470 plus one local agent), a third VM configured
# by cloud-init that you can log in to, the hosts, and a placement dry run.
# `make demo` runs it end to end; by hand:
#
#   kvmd dev --listen 127.0.0.1:8470 --data-dir /tmp/kvmd-dev   # prints its token
#   export KVM_ENDPOINT=http://127.0.0.1:8470 KVM_TOKEN=<that token>
#   ssh-keygen -t ed25519 -N "" -f ./demo_key
#   terraform apply -var "ssh_public_key=$(cat demo_key.pub)" -var guest_image=debian-12
#   ssh -i demo_key -p <port from the guest output> debian@127.0.0.1
#
# Without the Debian image (make image-debian) leave guest_image at busybox:
# it has no SSH server, but it reports the hostname and the user data digest
# it read (GET /v1/vms/{id}/guest). With the sim driver, -var image=sim
# -var guest_image=sim.

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

variable "guest_image" {
  description = "Image of the guest you log in to: debian-12 (make image-debian), busybox (no SSH server) or sim."
  type        = string
  default     = "busybox"
}

variable "ssh_public_key" {
  description = "OpenSSH public key to log in with (make demo generates one); empty: none."
  type        = string
  default     = ""
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

# A guest configured by cloud-init: the key, a hostname, a file. The apply
# waits until cloud-init in the guest has finished (busybox reports the same
# line once it read its seed; the sim driver reports what the seed holds).
# Changing the user data, key or meta-data replaces this VM.
locals {
  debian = var.guest_image == "debian-12"
}

resource "kvm_vm" "guest" {
  name       = "demo-guest"
  image      = var.guest_image
  vcpus      = 1
  memory_mib = local.debian ? 1024 : 128
  disk_mib   = local.debian ? 4096 : 256

  ssh_authorized_keys = var.ssh_public_key == "" ? null : [var.ssh_public_key]
  meta_data = {
    "local-hostname" = "demo-guest"
  }
  user_data = <<-EOT
    #cloud-config
    write_files:
      - path: /etc/kvm-demo
        content: "configured by cloud-init from terraform\n"
  EOT
  wait_for  = "cloud_init"

  # SSH (22) and HTTP (80) through ports on 127.0.0.1 of the host.
  network_interface {
    network = "default"
    port_forward {
      guest_port = 22
    }
    port_forward {
      guest_port = 80
    }
  }

  timeouts {
    create = "20m"
  }
}

# Both data sources wait for the VMs, so they show the fleet with them placed.
data "kvm_hosts" "all" {
  depends_on = [kvm_vm.demo, kvm_vm.guest]
}

data "kvm_placement" "next" {
  image      = var.image
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256

  depends_on = [kvm_vm.demo, kvm_vm.guest]
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

output "guest" {
  description = "The cloud-init guest: how to reach it, and what it was given."
  value = {
    id               = kvm_vm.guest.id
    image            = kvm_vm.guest.image
    hostname         = kvm_vm.guest.hostname
    user_data_sha256 = kvm_vm.guest.user_data_sha256
    started_from     = kvm_vm.guest.started_from
    ssh_port         = kvm_vm.guest.network_interface[0].port_forward[0].host_port
    ssh              = "ssh -p ${kvm_vm.guest.network_interface[0].port_forward[0].host_port} debian@${kvm_vm.guest.network_interface[0].port_forward[0].host_address}"
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
  description = "Where one more VM of the demo's shape would go now."
  value = {
    fits     = data.kvm_placement.next.fits
    host     = data.kvm_placement.next.chosen_host
    score    = data.kvm_placement.next.score
    rejected = { for r in data.kvm_placement.next.rejected : r.host => r.reason }
  }
}
