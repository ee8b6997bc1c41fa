# A VM is imported by its id (see the kvm_vm data source, or GET /v1/vms).
terraform import kvm_vm.web 01a22b30-2fac-7790-9c78-33c7bb4e522b
