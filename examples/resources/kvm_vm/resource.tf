# The control API places the VM on the best host and boots it. A later change
# of vcpus or memory_mib resizes it in place (the guest restarts, its disk
# stays); a change of name renames it in place.
resource "kvm_vm" "web" {
  name       = "web-1"
  image      = "busybox"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 2048
  labels = {
    role = "web"
  }

  timeouts {
    create = "15m"
  }
}

# A fixed address on a nat network (kvm_network "lan", cidr 10.20.0.0/24).
# Changing network_interface blocks replaces the VM.
resource "kvm_vm" "db" {
  name       = "db-1"
  image      = "busybox"
  vcpus      = 2
  memory_mib = 1024
  disk_mib   = 4096

  network_interface {
    network      = "lan"
    ipv4_address = "10.20.0.10"
  }
}

# Pinned to one host and kept stopped; power_state and labels change in place.
resource "kvm_vm" "batch" {
  name        = "batch-1"
  image       = "busybox"
  vcpus       = 1
  memory_mib  = 256
  disk_mib    = 1024
  host        = "node1"
  power_state = "stopped"
}

# Three replicas of one service, never two in one rack: hosts carry a
# rack label (kvm_host labels), and the group is capped at one per rack.
resource "kvm_vm" "db" {
  count      = 3
  name       = "db-${count.index}"
  image      = "busybox"
  vcpus      = 2
  memory_mib = 1024
  disk_mib   = 4096

  constraints {
    host_labels    = { disk = "ssd" }
    group          = "db"
    spread_by      = "label:rack"
    max_per_domain = 1
  }
}

# A Debian cloud guest configured by cloud-init: an SSH key for the image's
# default user "debian", a package and a file. The apply waits until
# cloud-init in the guest has finished (or fails at timeouts.create with the
# end of the serial console in the error). Changing user_data, the keys,
# meta_data or network_config replaces the VM: the guest reads them once.
resource "kvm_vm" "app" {
  name       = "app-1"
  image      = "debian-12"
  vcpus      = 2
  memory_mib = 1024
  disk_mib   = 4096

  ssh_authorized_keys = [file("~/.ssh/id_ed25519.pub")]
  meta_data = {
    "local-hostname" = "app-1"
  }
  user_data = <<-EOT
    #cloud-config
    packages: [nginx]
    write_files:
      - path: /etc/motd
        content: "managed by terraform\n"
  EOT

  wait_for = "cloud_init"

  # Reach the guest's SSH port on 127.0.0.1:<host_port> of its host.
  network_interface {
    network = "default"
    port_forward {
      guest_port = 22
    }
  }

  timeouts {
    create = "20m"
  }
}

# Secret user data kept out of the plan and the state (Terraform or OpenTofu 1.11+):
# only its SHA-256 is kept. Bump user_data_wo_version to replace the VM with
# the same secret (for example after rotating it elsewhere).
variable "worker_user_data" {
  type      = string
  sensitive = true
}

resource "kvm_vm" "worker" {
  name       = "worker-1"
  image      = "debian-12"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 4096

  user_data_wo         = var.worker_user_data
  user_data_wo_version = 1
  wait_for             = "ip"
}

# With the QEMU guest agent (the Debian image runs qemu-guest-agent): the
# create waits for it, the addresses it reports are in
# network_interface[*].ipv4_addresses (also on a bridge network whose
# addresses the control plane does not assign), stops go through it and a
# kvm_fork of this VM freezes its file systems for the snapshot.
resource "kvm_vm" "db" {
  name        = "db-1"
  image       = "debian-12"
  vcpus       = 2
  memory_mib  = 1024
  disk_mib    = 8192
  guest_agent = true
  wait_for    = "agent"

  network_interface {
    network = "default"
  }

  timeouts {
    create = "20m"
  }
}

output "db_addresses" {
  value = kvm_vm.db.network_interface[0].ipv4_addresses
}

output "web_placement" {
  value = kvm_vm.web.placement_summary
}

# Without network_interface blocks a VM has one NIC on the user-mode network
# "default": its address is QEMU's 10.0.2.15.
output "db_address" {
  value = kvm_vm.db.ipv4_address
}
