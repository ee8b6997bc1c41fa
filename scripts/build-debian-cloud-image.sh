#!/usr/bin/env bash
# build-debian-cloud-image.sh IMAGE_DIR: build two partitioned, firmware-
# booted Debian 12 cloud images into IMAGE_DIR, the shapes distributions
# publish (one disk that the firmware boots, no kernel outside it):
#
#   debian-12-cloud-bios  MBR; partition 1 a FAT boot partition holding the
#                         kernel, the initrd and syslinux.cfg, with syslinux
#                         installed in it (syslinux --install) and syslinux's
#                         mbr.bin in sector 0; partition 2 the root.
#   debian-12-cloud-uefi  GPT; partition 1 an EFI system partition holding
#                         EFI/BOOT/BOOTX64.EFI, a GRUB made by
#                         grub-mkstandalone with its grub.cfg inside, which
#                         loads the kernel and initrd from the root;
#                         partition 2 the root. Sector 0 is the protective
#                         MBR sfdisk writes: no BIOS boot code, so only UEFI
#                         boots it.
#
# Both are derived from the debian-12 kernel bundle (make image-debian),
# which must be in IMAGE_DIR: its root file system (label "root", fstab by
# label, cloud-init with NoCloud, growpart from cloud-guest-utils) becomes
# partition 2 as it is, and its kernel and initrd boot it. Nothing is
# mounted: the partitions are files written with sfdisk, mkfs.vfat, mtools
# and dd, then put together. cloud-init's growpart grows partition 2 to the
# VM's disk at the first boot, and resize2fs the file system.
#
# The result is cached outside the checkout (KVM_IMAGE_CACHE, default
# ~/.cache/kvmfleet/images), keyed by this script's sha256 and the
# debian-12 build it derives from; a build takes seconds.
#
# Needs: qemu-img, sfdisk (fdisk), mkfs.vfat (dosfstools), mtools, syslinux
# (+ syslinux-common for mbr.bin), grub-mkstandalone (grub-common) with
# grub-efi-amd64-bin. No root needed.
set -euo pipefail

ROOT_SRC=debian-12
BOOT_MIB=64
# The kernel command line of both images: the root by its label, the
# console on the serial port as the agent reads it.
CMDLINE="root=LABEL=root ro console=ttyS0 panic=-1"
MBR_BIN=${SYSLINUX_MBR:-/usr/lib/syslinux/mbr/mbr.bin}

out=${1:?usage: build-debian-cloud-image.sh IMAGE_DIR}
log() { printf 'build-debian-cloud-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

for c in qemu-img sfdisk mkfs.vfat mcopy mmd syslinux grub-mkstandalone sha256sum; do
	command -v "$c" >/dev/null || die "$c not found: ./scripts/deps.sh cloud (qemu-utils fdisk dosfstools mtools syslinux syslinux-common grub-efi-amd64-bin)"
done
[ -f "$MBR_BIN" ] || die "$MBR_BIN not found: apt-get install syslinux-common"
[ -d /usr/lib/grub/x86_64-efi ] || die "/usr/lib/grub/x86_64-efi not found: apt-get install grub-efi-amd64-bin"

mkdir -p "$out"
out=$(cd "$out" && pwd)
src="$out/$ROOT_SRC"
[ -f "$src/image.json" ] || die "$src not found: build the Debian kernel bundle first (make image-debian)"
src_build=$(sed -n 's/.*"build": "\([^"]*\)".*/\1/p' "$src/image.json")
[ -n "$src_build" ] || die "$src/image.json has no build id"
script_sha=$(sha256sum "$0" | cut -c1-16)
src_sha=$(printf '%s' "$src_build" | sha256sum | cut -c1-16)
build_id="script=$script_sha from=$ROOT_SRC:$src_sha"

up_to_date() { [ -f "$out/$1/image.json" ] && grep -qF "\"build\": \"$build_id\"" "$out/$1/image.json"; }
if up_to_date debian-12-cloud-bios && up_to_date debian-12-cloud-uefi; then
	log "$out/debian-12-cloud-{bios,uefi} are up to date ($build_id)"
	exit 0
fi

cache_root=${KVM_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmfleet/images}
cached="$cache_root/debian-12-cloud-$script_sha-$src_sha"

work=
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
export MTOOLS_SKIP_CHECK=1

# Layout, in MiB: 1 MiB for the partition table (and GRUB-free gap), the
# boot partition, the root, 1 MiB at the end for GPT's backup table.
layout() {
	root_mib=$((($(stat -c %s "$work/root.raw") + (1 << 20) - 1) >> 20))
	boot_start=1
	root_start=$((boot_start + BOOT_MIB))
	total_mib=$((root_start + root_mib + 1))
}

# assemble NAME PTYPE-SCRIPT: the disk of image NAME from boot.fat and
# root.raw, partitioned by the sfdisk script, converted to qcow2.
assemble() {
	local name=$1 table=$2 raw="$work/$1.raw"
	truncate -s "${total_mib}M" "$raw"
	sfdisk --quiet --no-reread --no-tell-kernel "$raw" <<<"$table" >&2 || die "sfdisk $name failed"
	dd if="$work/boot.fat" of="$raw" bs=1M seek="$boot_start" conv=notrunc status=none
	dd if="$work/root.raw" of="$raw" bs=1M seek="$root_start" conv=notrunc,sparse status=none
}

finish() {
	local name=$1 firmware=$2 raw="$work/$1.raw"
	mkdir -p "$work/out/$name"
	qemu-img convert -f raw -O qcow2 "$raw" "$work/out/$name/disk.qcow2" || die "qemu-img convert $name failed"
	cat >"$work/out/$name/image.json" <<-EOF
		{
		  "name": "$name",
		  "kind": "disk",
		  "disk": "disk.qcow2",
		  "firmware": "$firmware",
		  "min_memory_mib": 512,
		  "build": "$build_id"
		}
	EOF
	rm -f "$raw"
}

# A FAT file system of BOOT_MIB in boot.fat, label $1, whose hidden
# sectors say it starts at boot_start MiB (syslinux's boot sector reads
# its files by absolute sector).
make_fat() {
	rm -f "$work/boot.fat"
	truncate -s "${BOOT_MIB}M" "$work/boot.fat"
	mkfs.vfat -n "$1" -h $((boot_start * 2048)) "$work/boot.fat" >/dev/null || die "mkfs.vfat failed"
}

build() {
	mkdir -p "$cache_root"
	work=$(mktemp -d "$cache_root/.build-debian-12-cloud.XXXXXX")
	log "root file system from $src/disk.qcow2"
	qemu-img convert -f qcow2 -O raw "$src/disk.qcow2" "$work/root.raw" || die "qemu-img convert failed"
	layout

	log "debian-12-cloud-bios: MBR, FAT boot partition with syslinux, root"
	make_fat BOOT
	cat >"$work/syslinux.cfg" <<-EOF
		SERIAL 0 115200
		DEFAULT linux
		PROMPT 0
		TIMEOUT 0
		LABEL linux
		  LINUX /vmlinuz
		  INITRD /initrd.img
		  APPEND $CMDLINE
	EOF
	mcopy -i "$work/boot.fat" "$src/vmlinuz" ::/vmlinuz
	mcopy -i "$work/boot.fat" "$src/initrd.img" ::/initrd.img
	mcopy -i "$work/boot.fat" "$work/syslinux.cfg" ::/syslinux.cfg
	syslinux --install "$work/boot.fat" || die "syslinux --install failed"
	assemble debian-12-cloud-bios "label: dos
start=${boot_start}MiB, size=${BOOT_MIB}MiB, type=c, bootable
start=${root_start}MiB, size=${root_mib}MiB, type=83"
	# syslinux's MBR code (440 bytes: the partition table stays) boots the
	# active partition's boot sector.
	dd if="$MBR_BIN" of="$work/debian-12-cloud-bios.raw" bs=440 count=1 conv=notrunc status=none
	finish debian-12-cloud-bios bios

	log "debian-12-cloud-uefi: GPT, EFI system partition with GRUB, root"
	make_fat EFI
	cat >"$work/grub.cfg" <<-EOF
		set timeout=0
		serial --unit=0 --speed=115200
		terminal_input serial console
		terminal_output serial console
		insmod part_gpt
		insmod ext2
		search --no-floppy --label root --set=root
		linux /vmlinuz $CMDLINE
		initrd /initrd.img
		boot
	EOF
	grub-mkstandalone -O x86_64-efi -o "$work/BOOTX64.EFI" --locales= --fonts= --themes= \
		"boot/grub/grub.cfg=$work/grub.cfg" || die "grub-mkstandalone failed"
	mmd -i "$work/boot.fat" ::/EFI ::/EFI/BOOT
	mcopy -i "$work/boot.fat" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI
	assemble debian-12-cloud-uefi "label: gpt
start=${boot_start}MiB, size=${BOOT_MIB}MiB, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=ESP
start=${root_start}MiB, size=${root_mib}MiB, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name=root"
	finish debian-12-cloud-uefi uefi

	rm -rf "$cached"
	mv "$work/out" "$cached"
	log "cached $cached"
}

if [ ! -f "$cached/debian-12-cloud-bios/image.json" ] || [ ! -f "$cached/debian-12-cloud-uefi/image.json" ]; then
	build
fi
for name in debian-12-cloud-bios debian-12-cloud-uefi; do
	rm -rf "$out/$name.tmp"
	cp -r --sparse=always "$cached/$name" "$out/$name.tmp"
	rm -rf "${out:?}/$name"
	mv "$out/$name.tmp" "$out/$name"
	log "built $out/$name ($build_id)"
done
