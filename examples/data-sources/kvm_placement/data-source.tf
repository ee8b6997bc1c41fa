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
  value = { for r in data.kvm_placement.big.rejected : r.host => "${r.reason}: ${r.detail}" }
}

# Would one more replica of group "db" find a rack without one?
data "kvm_placement" "next_db" {
  image      = "busybox"
  vcpus      = 2
  memory_mib = 1024
  disk_mib   = 4096

  constraints {
    group          = "db"
    spread_by      = "label:rack"
    max_per_domain = 1
  }
}

output "next_db_fits" {
  value = data.kvm_placement.next_db.fits
}
