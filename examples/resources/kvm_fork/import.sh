# A fork is imported by its id (POST /v1/forks answers it; GET /v1/vms/{id} of a child shows it as fork_id).
terraform import kvm_fork.workers 01a22b31-07c4-7d0e-a0b4-5c1e2f6a9d10
