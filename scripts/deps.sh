#!/usr/bin/env bash
# deps.sh [demo|test|debian|cloud|ci]: make sure the Debian packages a target needs are
# here. It checks for the commands on PATH; when some are missing and it runs
# as root on a machine with apt-get, it installs their packages; otherwise it
# prints the one command to run and exits 1, so that the caller can fall back
# (make demo to the sim driver, make test to skipping the real-QEMU tests).
#
#   demo: QEMU, qemu-img, passt (user-mode networks) and the tools
#         scripts/build-image.sh uses
#   test: the same (PostgreSQL is optional: the tests start their own from
#         the system's binaries, or use KVM_TEST_DATABASE_URL)
#   debian: mmdebstrap and mkfs.ext4 for the Debian guest (make image-debian)
#   cloud: the tools scripts/build-debian-cloud-image.sh uses (sfdisk,
#         mkfs.vfat, mtools, syslinux, grub-mkstandalone with its x86_64-efi
#         modules) and OVMF, the firmware of uefi guests (make image-debian-cloud)
#   ci:   debian and cloud plus PostgreSQL, chromium (the fleet page test),
#         promtool (prometheus) and systemd-analyze (systemd)
#
# KVM_DEPS_INSTALL=no never installs (only checks and prints).
set -euo pipefail

what=${1:-demo}
log() { printf 'deps: %s\n' "$*" >&2; }

# command -> Debian package that provides it.
declare -A pkg_of=(
	[qemu-system-x86_64]=qemu-system-x86
	[qemu-img]=qemu-utils
	[cpio]=cpio
	[gzip]=gzip
	[xz]=xz-utils
	[apt-get]=apt
	[dpkg-deb]=dpkg
	[passt]=passt
)
cmds=(qemu-system-x86_64 qemu-img passt cpio gzip xz apt-get dpkg-deb)
# Packages that provide no command the scripts call by name.
extra_pkgs=(busybox-static zstd kmod ca-certificates)

debian_image() {
	pkg_of[mmdebstrap]=mmdebstrap
	pkg_of[mkfs.ext4]=e2fsprogs
	cmds+=(mmdebstrap mkfs.ext4)
}
# The cloud images' tools, and OVMF (uefi guests; the agent needs it too).
cloud_image() {
	pkg_of[sfdisk]=fdisk
	pkg_of[mkfs.vfat]=dosfstools
	pkg_of[mcopy]=mtools
	pkg_of[syslinux]=syslinux
	pkg_of[grub-mkstandalone]=grub-common
	cmds+=(sfdisk mkfs.vfat mcopy syslinux grub-mkstandalone)
	extra_pkgs+=(syslinux-common grub-efi-amd64-bin ovmf)
}
case "$what" in
demo | test) ;;
debian)
	cmds=()
	extra_pkgs=()
	debian_image
	;;
cloud)
	cmds=()
	extra_pkgs=()
	cloud_image
	;;
ci)
	debian_image
	cloud_image
	pkg_of[chromium]=chromium
	pkg_of[promtool]=prometheus
	pkg_of[systemd-analyze]=systemd
	pkg_of[pg_ctlcluster]=postgresql
	pkg_of[curl]=curl
	cmds+=(chromium promtool systemd-analyze pg_ctlcluster curl)
	;;
*)
	log "usage: deps.sh demo|test|debian|cloud|ci"
	exit 2
	;;
esac

missing_pkgs() {
	local c
	for c in "${cmds[@]}"; do
		command -v "$c" >/dev/null 2>&1 || echo "${pkg_of[$c]}"
	done
	local p
	for p in "${extra_pkgs[@]}"; do
		if command -v dpkg-query >/dev/null 2>&1 &&
			! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
			echo "$p"
		fi
	done
}

mapfile -t missing < <(missing_pkgs | sort -u)
if [ "${#missing[@]}" -eq 0 ]; then
	log "every package '$what' needs is installed"
	exit 0
fi

if [ "${KVM_DEPS_INSTALL:-yes}" != no ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
	log "installing ${missing[*]} with apt-get"
	export DEBIAN_FRONTEND=noninteractive
	apt_install() { apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing[@]}" >&2; }
	if ! apt_install; then
		log "apt-get install failed: running apt-get update and trying again"
		apt-get -o DPkg::Lock::Timeout=300 update -q >&2 && apt_install || true
	fi
	mapfile -t missing < <(missing_pkgs | sort -u)
	if [ "${#missing[@]}" -eq 0 ]; then
		log "every package '$what' needs is installed"
		exit 0
	fi
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo "
log "missing Debian packages: ${missing[*]}"
log "install them with:"
printf '\n    %sapt-get install -y --no-install-recommends %s\n\n' "$sudo" "${missing[*]}" >&2
exit 1
