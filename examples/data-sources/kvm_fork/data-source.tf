# Look a fork up by its id.
data "kvm_fork" "workers" {
  id = "01a22b31-07c4-7d0e-a0b4-5c1e2f6a9d10"
}

output "worker_ids" {
  value = data.kvm_fork.workers.children[*].id
}
