# A host is imported by its name.
terraform import kvm_host.node1 node1
