variable "name" {
  description = "Prefix of every name the module makes: the network, the image (when it registers one), the VMs (<name>-web-<n>) and their placement group."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,40}$", var.name))
    error_message = "name must be 1-41 lower-case letters, digits or '-', starting with a letter: it becomes part of hostnames."
  }
}

variable "vm_count" {
  description = "How many web VMs."
  type        = number
  default     = 2

  validation {
    condition     = var.vm_count >= 1 && var.vm_count == floor(var.vm_count)
    error_message = "vm_count must be a whole number of at least 1."
  }
}

variable "image" {
  description = "Image of the VMs: the name of an image the hosts offer (for example busybox or debian-12), or, with image_source, the name to register that image under."
  type        = string
  default     = "busybox"
}

variable "image_source" {
  description = "Register the image from a URL (a kvm_image: the hosts fetch and verify it when a VM needs it) instead of using an image the hosts already offer. format is qcow2, raw or kernel (a kernel bundle such as the busybox image's)."
  type = object({
    source_url = string
    sha256     = string
    format     = optional(string, "kernel")
  })
  default = null
}

variable "cidr" {
  description = "IPv4 range of the tier's nat network; the control plane gives each VM a fixed address in it."
  type        = string
  default     = "10.90.0.0/24"
}

variable "vcpus" {
  description = "vCPUs of each VM."
  type        = number
  default     = 1
}

variable "memory_mib" {
  description = "Memory of each VM in MiB."
  type        = number
  default     = 128
}

variable "disk_mib" {
  description = "Disk of each VM in MiB."
  type        = number
  default     = 256
}

variable "user_data" {
  description = "Cloud-init user data of every VM, as a template: $${hostname} and $${index} are replaced per VM. Null: a #cloud-config that writes /etc/web-tier with the VM's name and index. Changing it replaces the VMs."
  type        = string
  default     = null
}

variable "ssh_authorized_keys" {
  description = "OpenSSH public keys for the image's default user on every VM. Changing them replaces the VMs."
  type        = list(string)
  default     = []
}

variable "spread_by" {
  description = "Failure domain the VMs are spread over: host, or label:<key> for a host label such as label:rack."
  type        = string
  default     = "host"
}

variable "max_per_domain" {
  description = "At most this many of the tier's VMs per failure domain (0: no cap, only spread by score). 1 is strict anti-affinity: the apply fails when there are fewer domains than VMs."
  type        = number
  default     = 0
}

variable "host_labels" {
  description = "Only hosts carrying all these labels take the VMs."
  type        = map(string)
  default     = {}
}

variable "wait_for" {
  description = "What each VM's create waits for: running, ip or cloud_init (see kvm_vm)."
  type        = string
  default     = "running"
}
