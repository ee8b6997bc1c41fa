# A Debian cloud image, fetched by each host the first time a VM needs it
# (from another host that has it, else from the URL) and checked against
# its sha256 while it streams.
resource "kvm_image" "debian" {
  name         = "debian-12"
  source_url   = "https://images.example.com/debian-12-generic-amd64.qcow2"
  sha256       = "0d4b5c2e0b1b7a6e7fd1c5e2a3c9f8b1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7"
  format       = "qcow2"
  min_disk_mib = 4096
}

# A UEFI-only cloud image (GPT, an EFI system partition, no BIOS boot
# code): its VMs boot with OVMF, each with its own UEFI variable store.
resource "kvm_image" "debian_uefi" {
  name         = "debian-12-uefi"
  source_url   = "https://images.example.com/debian-12-uefi-amd64.qcow2"
  sha256       = "3a7bd3e2360a3d29eea436fcfb7e44c735d117c42d1c1835420b6b9942dd4f1b"
  format       = "qcow2"
  firmware     = "uefi"
  min_disk_mib = 4096
}

# A kernel bundle (a tar of image.json, the kernel and the initrd) already
# on every host's disk, fetched by all hosts at once.
resource "kvm_image" "busybox" {
  name       = "busybox"
  source_url = "file:///srv/images/busybox.tar"
  sha256     = "5f3c8e0d8b8f4c6b2a1e9d7c5b3a1f0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a"
  format     = "kernel"
  prefetch   = true
}

resource "kvm_vm" "web" {
  name       = "web-1"
  image      = kvm_image.debian.name
  vcpus      = 2
  memory_mib = 2048
  disk_mib   = 8192
}
