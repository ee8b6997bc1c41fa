# A small web tier: its own nat network, an image (one the hosts offer, or
# one registered from a URL), and vm_count VMs with cloud-init user data,
# spread over failure domains by a placement group.

locals {
  image              = var.image_source == null ? var.image : kvm_image.this[0].name
  default_user_data  = <<-EOT
    #cloud-config
    write_files:
      - path: /etc/web-tier
        content: "$${hostname} $${index}\n"
  EOT
  user_data_template = coalesce(var.user_data, local.default_user_data)
}

resource "kvm_network" "this" {
  name = "${var.name}-net"
  mode = "nat"
  cidr = var.cidr
}

resource "kvm_image" "this" {
  count = var.image_source == null ? 0 : 1

  name       = var.image
  source_url = var.image_source.source_url
  sha256     = var.image_source.sha256
  format     = var.image_source.format
}

resource "kvm_vm" "web" {
  count = var.vm_count

  name       = "${var.name}-web-${count.index}"
  image      = local.image
  vcpus      = var.vcpus
  memory_mib = var.memory_mib
  disk_mib   = var.disk_mib
  labels = {
    tier = "${var.name}-web"
  }

  user_data = templatestring(local.user_data_template, {
    hostname = "${var.name}-web-${count.index}"
    index    = count.index
  })
  ssh_authorized_keys = length(var.ssh_authorized_keys) == 0 ? null : var.ssh_authorized_keys
  meta_data = {
    "local-hostname" = "${var.name}-web-${count.index}"
  }
  wait_for = var.wait_for

  network_interface {
    network = kvm_network.this.name
  }

  constraints {
    host_labels    = var.host_labels
    group          = "${var.name}-web"
    spread_by      = var.spread_by
    max_per_domain = var.max_per_domain
  }
}
