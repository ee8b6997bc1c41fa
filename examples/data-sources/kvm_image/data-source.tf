# Where an image is ready, fetching, or why it failed, per host.
data "kvm_image" "debian" {
  name = "debian-12"
}

output "debian_hosts" {
  value = data.kvm_image.debian.hosts
}
