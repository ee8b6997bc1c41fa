# A volume is imported by its id (or its name in the project).
terraform import kvm_volume.pgdata 7f6c2a9e-0d1b-4c3a-9e8f-112233445566
