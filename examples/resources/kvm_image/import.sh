# An image is imported by its name.
terraform import kvm_image.debian debian-12
