# Where would a VM of this shape go now, and why not elsewhere? Reserves nothing.
data "kvm_placement" "big" {
  image      = "busybox"
  vcpus      = 4
  memory_mib = 8192
  disk_mib   = 20480
}

output "big_vm_would_land_on" {
  value = data.kvm_placement.big.fits ? data.kvm_placement.big.chosen_host : "nowhere"
}

output "big_vm_rejections" {
  value = { for r in data.kvm_placement.big.rejected : r.host => r.reason }
}
