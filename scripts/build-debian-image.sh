#!/usr/bin/env bash
# build-debian-image.sh IMAGE_DIR: build the Debian 12 cloud guest "debian-12"
# into IMAGE_DIR/debian-12 from Debian packages only.
#
# mmdebstrap makes a minimal bookworm root file system with systemd,
# cloud-init (NoCloud), openssh-server and the cloud kernel; mkfs.ext4 -d
# turns it into a file system without mounting anything; qemu-img makes it a
# qcow2. The guest boots with its own kernel and initrd (root=/dev/vda), so
# the image is a kernel bundle with a base disk, like the busybox image.
#
# A build takes about 6 minutes and ~500 MB of downloads, so the result is
# kept in a cache outside the checkout (KVM_IMAGE_CACHE, default
# ~/.cache/kvmfleet/images), keyed by this script's own sha256: a rerun with
# the same script copies the cached image instead of building it again.
#
# Needs root (mmdebstrap's root mode, mknod in the root file system).
set -euo pipefail

NAME=debian-12
SUITE=bookworm
# Packages on top of minbase. ifupdown + isc-dhcp-client is what cloud-init's
# ENI renderer drives on Debian; e2fsprogs lets cloud-init grow the root file
# system when the VM's disk is larger than the image, and cloud-guest-utils
# (growpart) grows a partitioned root. qemu-guest-agent answers the QEMU
# guest agent channel of a VM with guest_agent = true (udev starts it when
# the virtio-serial port org.qemu.guest_agent.0 appears; without the channel
# it stays off).
PACKAGES="systemd-sysv,udev,dbus,cloud-init,openssh-server,linux-image-cloud-amd64,initramfs-tools,ifupdown,isc-dhcp-client,iproute2,iputils-ping,netbase,sudo,e2fsprogs,cloud-guest-utils,qemu-guest-agent,ca-certificates,procps,less,locales"
# Size of the root file system (the VM's disk may be larger; it grows).
ROOT_MIB=2048

out=${1:?usage: build-debian-image.sh IMAGE_DIR}
log() { printf 'build-debian-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap and mknod in the root file system); run it with sudo"
for c in mmdebstrap mkfs.ext4 qemu-img sha256sum; do
	command -v "$c" >/dev/null || die "$c not found: apt-get install mmdebstrap e2fsprogs qemu-utils"
done

script_sha=$(sha256sum "$0" | cut -c1-16)
build_id="script=$script_sha suite=$SUITE"
mkdir -p "$out"
out=$(cd "$out" && pwd)
img="$out/$NAME"
if [ -f "$img/image.json" ] && grep -qF "\"build\": \"$build_id\"" "$img/image.json"; then
	log "$img is up to date ($build_id)"
	exit 0
fi

cache_root=${KVM_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmfleet/images}
cached="$cache_root/$NAME-$script_sha"

# The Debian mirror apt already uses (deb822 sources or a classic list).
mirror() {
	local uri
	uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
	[ -n "$uri" ] || uri=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
	echo "${uri:-http://deb.debian.org/debian}"
}

work=
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
build() {
	local root
	mkdir -p "$cache_root"
	work=$(mktemp -d "$cache_root/.build-$NAME.XXXXXX")
	root="$work/root"
	local m
	m=$(mirror)
	log "mmdebstrap $SUITE from $m (about 6 minutes)"
	mmdebstrap --variant=minbase --mode=root --include="$PACKAGES" \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
		--customize-hook='chroot "$1" systemctl enable ssh.service' \
		"$SUITE" "$root" "$m" >&2 || die "mmdebstrap failed"

	log "configuring the guest"
	# Keep the interfaces.d include: cloud-init writes the NICs there.
	cat >"$root/etc/network/interfaces" <<-'EOF'
		auto lo
		iface lo inet loopback
		source /etc/network/interfaces.d/*
	EOF
	mkdir -p "$root/etc/network/interfaces.d"
	# By label: /dev/vda here, a partition of the disk in the cloud images
	# derived from this one (build-debian-cloud-image.sh).
	echo 'LABEL=root / ext4 defaults,errors=remount-ro 0 1' >"$root/etc/fstab"
	# NoCloud only; C.UTF-8 needs no locale-gen, so cloud-init's locale
	# module succeeds without generating locales at every first boot.
	printf 'datasource_list: [ NoCloud, None ]\nlocale: C.UTF-8\n' >"$root/etc/cloud/cloud.cfg.d/90_kvmfleet.cfg"
	echo debian >"$root/etc/hostname"
	# Every VM gets its own identity: machine-id at first boot, SSH host
	# keys from cloud-init.
	: >"$root/etc/machine-id"
	rm -f "$root"/etc/ssh/ssh_host_*
	rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb

	local kernel initrd
	kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -n1)
	initrd=$(ls "$root"/boot/initrd.img-* | sort -V | tail -n1)
	[ -f "$kernel" ] && [ -f "$initrd" ] || die "no kernel or initrd in the root file system"
	mkdir -p "$work/$NAME"
	cp "$kernel" "$work/$NAME/vmlinuz"
	cp "$initrd" "$work/$NAME/initrd.img"

	log "mkfs.ext4 -d (${ROOT_MIB} MiB) and qemu-img convert"
	mkfs.ext4 -q -F -L root -d "$root" "$work/root.raw" "${ROOT_MIB}M" >/dev/null || die "mkfs.ext4 failed"
	qemu-img convert -f raw -O qcow2 "$work/root.raw" "$work/$NAME/disk.qcow2" || die "qemu-img convert failed"
	cat >"$work/$NAME/image.json" <<-EOF
		{
		  "name": "$NAME",
		  "kind": "kernel",
		  "kernel": "vmlinuz",
		  "initrd": "initrd.img",
		  "disk": "disk.qcow2",
		  "cmdline": "console=ttyS0 root=/dev/vda rw panic=-1",
		  "machine": "q35",
		  "min_memory_mib": 512,
		  "build": "$build_id"
		}
	EOF
	rm -rf "$cached"
	mv "$work/$NAME" "$cached"
	log "cached $cached"
}

if [ ! -f "$cached/image.json" ]; then
	build
fi
rm -rf "$img.tmp"
cp -r --sparse=always "$cached" "$img.tmp"
rm -rf "$img"
mv "$img.tmp" "$img"
log "built $img ($build_id)"
