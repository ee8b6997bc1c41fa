data "kvm_host" "node1" {
  name = "node1"
}

output "node1_free_memory_mib" {
  value = data.kvm_host.node1.free.memory_mib
}
