#!/usr/bin/env bash
# build-image.sh IMAGE_DIR: build the demo guest image "busybox" into
# IMAGE_DIR/busybox from Debian packages only: the kernel of linux-image-amd64
# (direct boot) and an initramfs with busybox-static, the virtio modules the
# guest needs and an /init that prints "kvm-guest-ready", whether it sees a
# vmgenid device, the disk it sees ("disk vda <bytes>"), the marker at the
# start of that disk if there is one, its memory and vCPUs, then "tick N"
# every second on the serial console (and "disk vda <bytes>" again when the
# disk grows while the guest runs). Each disk with a virtio serial (a volume;
# the VM's own disk and the seed have none) is printed as "kvm-guest-disk
# <serial> <bytes>" at boot and again whenever one appears or changes size
# (hot attach, online grow), and "kvm-guest-disk-gone <serial>" when it goes. With a NIC (virtio-net) it brings eth0
# up by DHCP (udhcpc), prints "kvm-guest-ip <address>" once it has a lease,
# and serves HTTP on port 80 (busybox httpd) with a page that names its
# hostname, and /cgi-bin/get?<host[:port]>, which fetches
# http://<host[:port]>/ from inside the guest (tests prove guest-to-guest and
# guest-to-gateway traffic). With a NoCloud seed (a disk labelled cidata, ISO
# 9660) it prints cloud-init's first line "Cloud-init v. kvm-busybox running
# ...", sets the seed's local-hostname and prints "kvm-guest-hostname <name>"
# and "kvm-guest-userdata-sha256 <hex of the user-data file>"; user data that
# starts with "#!" is run as a script (output on the console; a failure
# prints a cloud-init "Failed running" line), and then cloud-init's final
# line "Cloud-init v. kvm-busybox finished at <date>. Datasource NoCloud.";
# without a seed none of these. It runs no cloud-init modules: other user
# data and the network-config are only read.
#
# An idle guest costs its host little: its loops read /sys with the shell's
# own read and wait with read -t on a FIFO nobody writes (nap), never a
# process; busybox's cat and sleep are a fork and an exec each, which under
# TCG cost more than the loops' own work.
#
# Idempotent: an image built by this script version from the same packages
# is left alone. Run as root or as a user who may run apt-get download.
set -euo pipefail

# Bump when the init, the module list or the manifest changes.
SCRIPT_VERSION=17
NAME=busybox
# Modules the guest loads, in dependency order after resolution: virtio-mmio
# (microvm) and virtio-pci (q35) transports, the disk, and the ACPI power
# button with evdev so that a stop's ACPI power-down reaches the init, the
# NIC (virtio_net, which needs net_failover and failover), and isofs (with
# cdrom) to read a NoCloud seed.
MODULES="virtio_mmio virtio_pci virtio_blk virtio_net button evdev isofs"

out=${1:?usage: build-image.sh IMAGE_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
img="$out/$NAME"

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

for c in apt-cache apt-get dpkg-deb cpio gzip xz; do
	command -v "$c" >/dev/null || die "$c not found: this script needs a Debian host with apt and cpio"
done

# The kernel package behind linux-image-amd64, e.g. linux-image-6.1.0-57-amd64.
resolve_kernel() {
	apt-cache depends linux-image-amd64 2>/dev/null |
		awk '$1 == "Depends:" && $2 ~ /^linux-image-6\.1\..*-amd64$/ { print $2; exit }'
}
kpkg=$(resolve_kernel || true)
if [ -z "$kpkg" ]; then
	log "linux-image-amd64 not known to apt: running apt-get update"
	apt-get update -qq >&2 || die "apt-get update failed"
	kpkg=$(resolve_kernel) || true
	[ -n "$kpkg" ] || die "cannot resolve linux-image-amd64 to a linux-image-6.1.*-amd64 package"
fi
kver=${kpkg#linux-image-}

build_id="script=$SCRIPT_VERSION kernel=$kpkg busybox=$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null || echo download)"
if [ -f "$img/image.json" ] && [ -f "$img/vmlinux" ] && [ -f "$img/initrd.img" ] &&
	grep -qF "\"build\": \"$build_id\"" "$img/image.json"; then
	log "$img is up to date ($build_id)"
	exit 0
fi

work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

# Keep downloaded packages beside the images so a rebuild needs no network.
debs="$out/.debs"
mkdir -p "$debs"
fetch_deb() { # package -> path of its .deb in $debs
	local pkg=$1 f
	f=$(ls "$debs/${pkg}_"*.deb 2>/dev/null | head -n1 || true)
	if [ -z "$f" ]; then
		log "downloading $pkg"
		(cd "$debs" && apt-get download -q "$pkg" >&2 2>/dev/null) ||
			{ log "apt-get download $pkg failed: running apt-get update"; apt-get update -qq >&2 && (cd "$debs" && apt-get download -q "$pkg" >&2); } ||
			die "cannot download $pkg"
		f=$(ls "$debs/${pkg}_"*.deb | head -n1)
	fi
	echo "$f"
}

kdeb=$(fetch_deb "$kpkg")
log "extracting the kernel and modules of $kpkg"
mkdir kpkg
dpkg-deb --fsys-tarfile "$kdeb" | tar -x -C kpkg --wildcards \
	"./boot/vmlinuz-$kver" "./lib/modules/$kver/kernel/drivers/virtio/*" \
	"./lib/modules/$kver/kernel/drivers/block/virtio_blk.ko" \
	"./lib/modules/$kver/kernel/drivers/net/virtio_net.ko" \
	"./lib/modules/$kver/kernel/drivers/net/net_failover.ko" \
	"./lib/modules/$kver/kernel/net/core/failover.ko" \
	"./lib/modules/$kver/kernel/drivers/acpi/button.ko" \
	"./lib/modules/$kver/kernel/drivers/input/evdev.ko" \
	"./lib/modules/$kver/kernel/fs/isofs/isofs.ko" \
	"./lib/modules/$kver/kernel/drivers/cdrom/cdrom.ko"
moddir="kpkg/lib/modules/$kver/kernel"

# busybox-static: the installed one, else from its package.
if dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'install ok installed' && [ -x /bin/busybox ]; then
	busybox=/bin/busybox
else
	bdeb=$(fetch_deb busybox-static)
	mkdir bpkg
	dpkg-deb -x "$bdeb" bpkg
	busybox=bpkg/bin/busybox
fi
banner=$("$busybox" --help 2>&1 | head -n1 || true)
case "$banner" in BusyBox*) ;; *) die "$busybox does not run" ;; esac

root="$work/root"
mkdir -p "$root"/{bin,dev,proc,sys,tmp,etc,lib/modules}
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
	[ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done
mknod "$root/dev/console" c 5 1 2>/dev/null || log "cannot mknod /dev/console (not root): the init opens it after mounting devtmpfs"

# Resolve module dependencies (depends= in each .ko) into a load order.
declare -A seen=()
order=()
modpath() {
	local f
	f=$(find "$moddir" -name "$1.ko" -o -name "${1//_/-}.ko" | head -n1)
	[ -n "$f" ] || die "module $1 not found in $kpkg"
	echo "$f"
}
add_module() {
	local m=$1 f dep deps
	[ -n "${seen[$m]:-}" ] && return
	seen[$m]=1
	f=$(modpath "$m")
	deps=$(tr '\0' '\n' <"$f" | sed -n 's/^depends=//p' | tr ',' ' ')
	for dep in $deps; do add_module "$dep"; done
	cp "$f" "$root/lib/modules/$m.ko"
	order+=("$m")
}
for m in $MODULES; do add_module "$m"; done
printf '%s\n' "${order[@]}" >"$root/etc/modules"
log "modules: ${order[*]}"

cat >"$root/init" <<'EOF'
#!/bin/busybox sh
# The guest's whole userland: mount, load modules, report, tick.
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec 0</dev/console 1>/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# nap SECONDS: a wait without a process (see the top of this script).
mkfifo /tmp/.nap && exec 3<>/tmp/.nap && rm /tmp/.nap
nap() { read -r -t "$1" _ <&3; }
# The kernel's uptime when init starts: the boot time split of bench/.
echo "kvm-guest-init uptime $(cut -d' ' -f1 /proc/uptime)"
while read -r m; do
	insmod "/lib/modules/$m.ko" 2>/dev/null
done </etc/modules
# Disks show up as their driver probes; give them a moment.
i=0
while [ $i -lt 20 ] && ! ls /sys/block/vd* >/dev/null 2>&1 && ls /sys/bus/virtio/devices/* >/dev/null 2>&1; do
	nap 0.1
	i=$((i + 1))
done
# A stop sends an ACPI power-button press: power off on any input event.
# kvm_guest_ignore_acpi on the kernel command line leaves it out, so tests
# can prove that a stop also ends a guest that ignores ACPI.
if ! grep -q kvm_guest_ignore_acpi /proc/cmdline; then
	for ev in /dev/input/event*; do
		[ -e "$ev" ] || continue
		# Through the kernel log: printk reaches the serial port before the
		# power-off, a tty write may still sit in its buffer.
		(dd if="$ev" bs=24 count=1 >/dev/null 2>&1 && echo "<2>kvm-guest-powerdown" >/dev/kmsg && sync && poweroff -f) &
	done
fi
echo "kvm-guest-ready"
# The VM generation id device (q35 describes it in ACPI; forks change it).
if [ -e /sys/bus/acpi/devices/QEMUVGID:00 ]; then echo "vmgenid present"; else echo "vmgenid absent"; fi
found=0
for d in /sys/block/vd*; do
	[ -e "$d" ] || continue
	sectors=$(cat "$d/size")
	echo "disk ${d##*/} $((sectors * 512))"
	# The size printed, so that a growth is printed again (tick loop below).
	[ "${d##*/}" = vda ] && vda=$sectors
	# A marker a test wrote at the start of the disk (resizes keep the disk).
	m=$(head -c 64 "/dev/${d##*/}" 2>/dev/null | tr -dc 'A-Za-z0-9:._-')
	case $m in kvm-marker:*) echo "kvm-guest-disk-marker ${d##*/} $m" ;; esac
	found=1
done
[ $found = 1 ] || echo "disk none"
# A NoCloud seed: the disk whose ISO 9660 volume label (32 bytes at byte
# 32808) is cidata. Cloud-init's first line, its hostname and the digest of
# its user data; cloud-init's final line comes once the user data ran (below).
seeded=0
for d in /sys/block/vd*; do
	[ -e "$d" ] || continue
	dev=/dev/${d##*/}
	label=$(dd if="$dev" bs=1 skip=32808 count=32 2>/dev/null | tr -d ' \0')
	case "$label" in cidata | CIDATA) ;; *) continue ;; esac
	mkdir -p /seed
	if ! mount -t iso9660 -o ro "$dev" /seed; then
		echo "kvm-guest-seed-error cannot mount $dev"
		break
	fi
	seeded=1
	echo "Cloud-init v. kvm-busybox running 'init' at $(date -R). Datasource NoCloud."
	h=$(sed -n 's/^ *"local-hostname": *"\([^"]*\)".*/\1/p' /seed/meta-data | head -n1)
	if [ -n "$h" ]; then
		hostname "$h"
		echo "kvm-guest-hostname $h"
	fi
	echo "kvm-guest-userdata-sha256 $(sha256sum /seed/user-data | cut -d' ' -f1)"
	break
done
# Volumes: every disk with a virtio serial, polled once a second (the
# kernel binds a hot-plugged virtio disk by itself; polling /sys needs no
# mdev and sees detaches and growth the same way; each poll wakes an idle
# guest, which under TCG costs its host CPU time).
(
	prev=""
	while :; do
		cur=""
		for d in /sys/block/vd*; do
			s=
			read -r s 2>/dev/null <"$d/serial"
			[ -n "$s" ] || continue
			read -r sectors 2>/dev/null <"$d/size" || continue
			cur="$cur $s:$((sectors * 512))"
		done
		for e in $cur; do
			case " $prev " in *" $e "*) ;; *) echo "kvm-guest-disk ${e%%:*} ${e##*:}" ;; esac
		done
		for e in $prev; do
			case " $cur " in *" ${e%%:*}:"*) ;; *) echo "kvm-guest-disk-gone ${e%%:*}" ;; esac
		done
		prev=$cur
		nap 1
	done
) &
# The shape the guest sees (resizes change it).
echo "kvm-guest-memory $(sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo) kB"
echo "kvm-guest-cpus $(grep -c ^processor /proc/cpuinfo)"
# A NIC: DHCP in the background (udhcpc keeps renewing; /etc/udhcpc.sh
# configures eth0 and prints the address), HTTP on port 80 at once.
i=0
while [ $i -lt 20 ] && [ ! -e /sys/class/net/eth0 ] && grep -qx 0x0001 /sys/bus/virtio/devices/*/device 2>/dev/null; do
	nap 0.1
	i=$((i + 1))
done
if [ -e /sys/class/net/eth0 ]; then
	[ "$(hostname)" = "(none)" ] && hostname busybox
	ip link set lo up
	ip link set eth0 up
	mkdir -p /www/cgi-bin
	cp /etc/cgi-get /www/cgi-bin/get
	echo "kvm-guest $(hostname)" >/www/index.html
	httpd -p 80 -h /www
	udhcpc -f -i eth0 -s /etc/udhcpc.sh -t 3 -T 1 -A 1 -O mtu >/dev/null 2>&1 &
else
	echo "nic none"
fi
# The seed's user data, as cloud-init's final stage would: a script (#!) is
# run with its output on the console, other user data is only digested.
# Then cloud-init's final line, or its failure line when the script failed.
# In the background: the guest goes on (a script may never finish).
if [ $seeded = 1 ]; then
	(
		case "$(head -c 2 /seed/user-data)" in
		'#!')
			cp /seed/user-data /tmp/user-data
			chmod 755 /tmp/user-data
			/tmp/user-data
			rc=$?
			if [ $rc != 0 ]; then
				echo "kvm-busybox cloud-init[1]: util.py[WARNING]: Failed running /tmp/user-data [$rc]"
			fi
			;;
		esac
		echo "Cloud-init v. kvm-busybox finished at $(date -R). Datasource NoCloud."
	) &
fi
n=0
while :; do
	echo "tick $n"
	# A disk grown while the guest runs (QMP block_resize): its new size.
	s=
	read -r s 2>/dev/null </sys/block/vda/size
	if [ -n "$s" ] && [ "$s" != "$vda" ]; then
		vda=$s
		echo "disk vda $((s * 512))"
	fi
	n=$((n + 1))
	nap 1
done
EOF
chmod 755 "$root/init"

# udhcpc's hook: $ip, $subnet, $router, $hostname and $mtu (option 26, asked
# for with -O mtu: an overlay network's guests get the underlay's MTU less
# the VXLAN overhead) come from the lease.
cat >"$root/etc/udhcpc.sh" <<'EOF'
#!/bin/busybox sh
case "$1" in
deconfig)
	ip addr flush dev "$interface"
	ip link set "$interface" up
	;;
bound | renew)
	# The lease names the VM; a hostname set otherwise (not the default) wins.
	[ -n "$hostname" ] && [ "$(hostname)" = busybox ] && hostname "$hostname"
	echo "kvm-guest $(hostname) $ip" >/www/index.html
	if [ -n "$mtu" ] && [ "$(cat /sys/class/net/"$interface"/mtu)" != "$mtu" ]; then
		ip link set dev "$interface" mtu "$mtu"
		echo "kvm-guest-mtu $mtu" >/dev/console
	fi
	if ! ip addr show dev "$interface" | grep -q "inet $ip/"; then
		ip addr flush dev "$interface"
		ifconfig "$interface" "$ip" netmask "${subnet:-255.255.255.0}" up
		for r in $router; do
			route add default gw "$r" dev "$interface" && break
		done
		echo "kvm-guest-ip $ip" >/dev/console
	fi
	;;
esac
exit 0
EOF
chmod 755 "$root/etc/udhcpc.sh"

# GET /cgi-bin/get?<host[:port]>: what the guest fetches from there.
cat >"$root/etc/cgi-get" <<'EOF'
#!/bin/busybox sh
printf 'Content-Type: text/plain\r\n\r\n'
case "$QUERY_STRING" in
"" | *[!0-9A-Za-z.:-]*)
	echo "kvm-guest-fetch bad target"
	exit 0
	;;
esac
host=${QUERY_STRING%%:*}
port=80
case "$QUERY_STRING" in *:*) port=${QUERY_STRING##*:} ;; esac
# (busybox-static's wget crashes in static glibc; nc does not.)
out=$(printf 'GET / HTTP/1.0\r\nHost: %s\r\n\r\n' "$host" | nc -w 5 "$host" "$port" 2>&1)
case "$out" in
HTTP/*) printf '%s\n' "$out" | sed '1,/^\r*$/d' ;;
*) echo "kvm-guest-fetch failed $QUERY_STRING: $out" ;;
esac
EOF
chmod 755 "$root/etc/cgi-get"

new="$out/.$NAME.new"
rm -rf "$new"
mkdir -p "$new"
# The bzImage holds an xz-compressed ELF vmlinux with a PVH entry note.
# QEMU boots that ELF directly (PVH), which skips the real-mode setup and the
# in-guest decompression: under TCG that saves about half the boot.
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ' "kpkg/boot/vmlinuz-$kver" | head -n1 | cut -d: -f1 || true)
[ -n "$off" ] || die "no xz stream in vmlinuz-$kver: cannot extract vmlinux"
# (tail may die of SIGPIPE once xz has its one stream: only xz's status counts.)
xz -dc --single-stream <(tail -c +$((off + 1)) "kpkg/boot/vmlinuz-$kver") >"$new/vmlinux" ||
	die "extracting vmlinux from vmlinuz-$kver failed"
[ "$(head -c 4 "$new/vmlinux" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] || die "extracted vmlinux is not an ELF file"
(cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -9 >"$new/initrd.img"
cat >"$new/image.json" <<EOF
{
  "name": "$NAME",
  "kind": "kernel",
  "kernel": "vmlinux",
  "initrd": "initrd.img",
  "cmdline": "console=ttyS0 panic=-1 loglevel=4",
  "machine": "q35",
  "min_memory_mib": 64,
  "build": "$build_id"
}
EOF
# Swap the new image in; QEMU processes already running read their kernel
# at start and do not notice.
if [ -d "$img" ]; then
	mv "$img" "$out/.$NAME.old"
fi
mv "$new" "$img"
rm -rf "$out/.$NAME.old"
log "built $img ($build_id)"
