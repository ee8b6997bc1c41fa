# A volume made elsewhere, by name: where it lives and which VMs have it.
data "kvm_volume" "pgdata" {
  name = "pgdata"
}

output "pgdata_host" {
  value = data.kvm_volume.pgdata.host
}
