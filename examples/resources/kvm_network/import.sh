# A network is imported by its name.
terraform import kvm_network.lan lan
