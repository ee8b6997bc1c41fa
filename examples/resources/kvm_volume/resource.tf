# A database whose data outlives its VM: new user_data replaces the VM,
# and the new VM gets the same volume, on the volume's host.
resource "kvm_volume" "pgdata" {
  name     = "pgdata"
  size_mib = 20480
  labels   = { app = "postgres" }
}

resource "kvm_vm" "db" {
  name       = "db"
  image      = "debian-12"
  vcpus      = 2
  memory_mib = 4096
  disk_mib   = 10240
  user_data  = <<-EOT
    #cloud-config
    fs_setup:
      - device: ${kvm_volume.pgdata.device}
        filesystem: ext4
        overwrite: false
    mounts:
      - ["${kvm_volume.pgdata.device}", "/var/lib/postgresql", "ext4", "defaults,nofail", "0", "2"]
  EOT

  volume_attachment {
    volume = kvm_volume.pgdata.id
  }
}

# A copy-on-write clone of it (on the same host), for a test copy.
resource "kvm_volume" "pgdata_test" {
  name     = "pgdata-test"
  size_mib = 20480
  source = {
    volume = kvm_volume.pgdata.id
  }
}

# A build cache for a VM that already runs on node1: adding the
# volume_attachment block later is an in-place update that attaches the
# volume hot (the guest sees /dev/disk/by-id/virtio-<serial> without a
# reboot); removing the block detaches it. The volume must be on the VM's
# host.
resource "kvm_volume" "cache" {
  name     = "build-cache"
  size_mib = 10240
  host     = "node1"
}

resource "kvm_vm" "builder" {
  name       = "builder"
  image      = "busybox"
  vcpus      = 2
  memory_mib = 1024
  disk_mib   = 2048
  host       = "node1"

  volume_attachment {
    volume = kvm_volume.cache.id
  }
}

# A volume pinned to a host. Changing host moves it there in place (same
# id, same data) once no VM has it attached.
resource "kvm_volume" "archive" {
  name     = "archive"
  size_mib = 4096
  host     = "host-a"
}
