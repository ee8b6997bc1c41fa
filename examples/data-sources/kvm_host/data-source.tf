data "kvm_host" "node1" {
  name = "node1"
}

output "node1_free_memory_mib" {
  value = data.kvm_host.node1.free.memory_mib
}

# Warm VMs ready per image and shape of the host's warm pool.
output "node1_warm_ready" {
  value = { for p in data.kvm_host.node1.warm_pool : "${p.image}/${p.vcpus}x${p.memory_mib}x${p.disk_mib}" => p.ready }
}
