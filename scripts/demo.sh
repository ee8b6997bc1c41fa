#!/usr/bin/env bash
# The quickstart, end to end on the embedded default: kvmd dev (control API on
# SQLite + one local agent), terraform apply of examples/quickstart with the
# locally built provider (dev_overrides), a look at what it made, a login to
# its cloud-init guest with an SSH key made here, then destroy.
#
# The guest to log in to is the Debian cloud image when it is in the image
# directory or in make image-debian's cache (copied from there as root), else
# busybox, which has no SSH server: then the demo checks, without logging in,
# that the guest reports the hostname and user data digest Terraform applied.
#
# First scripts/deps.sh installs the Debian packages (as root with apt) and
# scripts/build-image.sh builds the busybox guest image. When either cannot
# be done, the demo says so in one line starting with "demo: FALLBACK" and
# runs the same quickstart on the sim driver (simulated VMs, image "sim").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BIN:-$root/bin}"
image_dir="${IMAGE_DIR:-${KVM_IMAGE_DIR:-$root/.cache/images}}"
listen="${KVM_DEMO_LISTEN:-127.0.0.1:8470}"
work="$(mktemp -d)"
token="demo-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
kvmd_pid=""

cleanup() {
  if [[ -n "$kvmd_pid" ]] && kill -0 "$kvmd_pid" 2>/dev/null; then
    kill "$kvmd_pid"; wait "$kvmd_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

for tool in terraform curl; do
  command -v "$tool" >/dev/null || { echo "demo: $tool is not on PATH; install it first" >&2; exit 1; }
done

step "Debian packages and the guest image"
driver=qemu
fallback=""
if ! "$root/scripts/deps.sh" demo; then
	fallback="Debian packages are missing (the command to install them is above)"
elif ! "$root/scripts/build-image.sh" "$image_dir"; then
	fallback="the busybox guest image could not be built into $image_dir (scripts/build-image.sh failed above)"
fi
# The Debian guest from make image-debian's cache goes into the image
# directory before kvmd starts: the agent offers the images it finds then.
debian_cache="${KVM_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmfleet/images}/debian-12-$(sha256sum "$root/scripts/build-debian-image.sh" | cut -c1-16)"
if [[ -z "$fallback" && ! -f "$image_dir/debian-12/image.json" && -f "$debian_cache/image.json" && "$(id -u)" == 0 ]]; then
	"$root/scripts/build-debian-image.sh" "$image_dir" || true # a copy from the cache
fi
if [[ -n "$fallback" ]]; then
	driver=sim
	printf '\n\033[1mdemo: FALLBACK to the sim driver: %s. The quickstart below runs on simulated VMs (image "sim"), not QEMU guests; install the packages and run make demo again for real guests.\033[0m\n' "$fallback"
fi

step "kvmd dev on $listen with the $driver driver (log: $work/kvmd.log)"
KVMD_TOKEN="$token" "$bin/kvmd" dev --listen "$listen" --driver "$driver" --data-dir "$work/data" --image-dir "$image_dir" \
  >"$work/kvmd.out" 2>"$work/kvmd.log" &
kvmd_pid=$!
for _ in $(seq 60); do
  curl -fsS "http://$listen/readyz" >/dev/null 2>&1 && break
  kill -0 "$kvmd_pid" 2>/dev/null || { cat "$work/kvmd.log" >&2; echo "demo: kvmd dev exited" >&2; exit 1; }
  sleep 0.5
done
grep -v "^{" "$work/kvmd.log" || true

image="busybox"
if [[ "$driver" == sim ]]; then image="sim"; fi

step "the guest to log in to, and an SSH key for it"
guest_image="$image"
if [[ "$driver" == qemu ]]; then
	if [[ -f "$image_dir/debian-12/image.json" ]]; then
		guest_image="debian-12"
	else
		echo "demo: no Debian guest image (make image-debian builds it, as root: minutes of mmdebstrap once, then cached; make test builds it too): the guest is busybox, which has no SSH server; the demo checks what it reports instead of logging in"
	fi
fi
ssh_public_key=""
if command -v ssh-keygen >/dev/null && command -v ssh >/dev/null; then
	ssh-keygen -q -t ed25519 -N "" -C "kvm-demo" -f "$work/demo_key"
	ssh_public_key="$(cat "$work/demo_key.pub")"
	echo "demo: made the key pair $work/demo_key (removed at the end)"
elif [[ "$guest_image" == debian-12 ]]; then
	echo "demo: ssh and ssh-keygen are not installed (apt-get install openssh-client): the guest is busybox instead"
	guest_image=busybox
fi
echo "demo: guest image $guest_image"

step "terraform apply examples/quickstart (provider from $bin via dev_overrides)"
cat >"$work/terraformrc" <<RC
provider_installation {
  dev_overrides {
    "kvmfleet/kvm" = "$bin"
  }
  direct {}
}
RC
cp "$root"/examples/quickstart/*.tf "$work/"
export TF_CLI_CONFIG_FILE="$work/terraformrc" TF_IN_AUTOMATION=1
export KVM_ENDPOINT="http://$listen" KVM_TOKEN="$token"
cd "$work"
tfvars=(-var "image=$image" -var "guest_image=$guest_image" -var "ssh_public_key=$ssh_public_key")
if [[ "$guest_image" == debian-12 ]]; then
	echo "demo: the Debian guest boots and runs cloud-init under TCG: the apply waits for it (a few minutes)"
fi
terraform apply -auto-approve -input=false "${tfvars[@]}"

step "what Terraform made"
terraform state list
terraform output

step "each guest answers on its forwarded port on 127.0.0.1"
if [[ "$driver" == sim ]]; then
	echo "demo: the sim driver simulates NICs and forwards (no guest listens): skipped"
else
	# {"demo-0":"http://127.0.0.1:PORT/",...}: one "name url" line each.
	terraform output -json http | grep -o '"[^"]*":"[^"]*"' | sed 's/^"\([^"]*\)":"\([^"]*\)"$/\1 \2/' |
	while read -r name url; do
		# busybox brings its NIC up right after boot: a few tries, bounded.
		body=""
		for _ in $(seq 30); do
			body=$(curl -fsS --max-time 5 "$url" 2>/dev/null) && break
			sleep 1
		done
		[[ -n "$body" ]] || { echo "demo: $name did not answer on $url" >&2; exit 1; }
		echo "$name ($url): $body"
	done
fi

step "log in to the cloud-init guest"
guest_id=$(terraform output -json guest | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
ssh_port=$(terraform output -json guest | sed -n 's/.*"ssh_port":\([0-9]*\).*/\1/p')
applied_sha=$(terraform output -json guest | sed -n 's/.*"user_data_sha256":"\([0-9a-f]*\)".*/\1/p')
case "$guest_image" in
debian-12)
	echo "demo: ssh -i $work/demo_key -p $ssh_port debian@127.0.0.1 'hostname; cat /etc/kvm-demo'"
	ok=""
	for _ in $(seq 12); do # sshd may restart once after cloud-init: a few tries, bounded
		if out=$(ssh -i "$work/demo_key" -p "$ssh_port" -o BatchMode=yes -o StrictHostKeyChecking=no \
			-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=10 \
			debian@127.0.0.1 'hostname; cat /etc/kvm-demo'); then
			ok=1
			break
		fi
		sleep 5
	done
	[[ -n "$ok" ]] || { echo "demo: could not log in to the Debian guest on 127.0.0.1:$ssh_port" >&2; exit 1; }
	echo "$out"
	[[ "$out" == *demo-guest*"configured by cloud-init from terraform"* ]] ||
		{ echo "demo: the guest answered, but not with its hostname and the file cloud-init wrote" >&2; exit 1; }
	echo "demo: logged in over SSH with the key Terraform gave the guest"
	;;
busybox)
	# No SSH server in busybox: what the guest read from its seed, as it
	# reported it on its console, against what Terraform applied.
	reported=$(curl -fsS -H "Authorization: Bearer $token" "http://$listen/v1/vms/$guest_id/guest")
	echo "GET /v1/vms/$guest_id/guest: $reported"
	[[ "$reported" == *'"cloud_init":"done"'* && "$reported" == *"\"user_data_sha256\":\"$applied_sha\""* &&
		"$reported" == *'"hostname":"demo-guest"'* ]] ||
		{ echo "demo: the busybox guest does not report the hostname and user data digest Terraform applied ($applied_sha)" >&2; exit 1; }
	echo "demo: the busybox guest read the applied user data (sha256 $applied_sha) and hostname; it has no SSH server to log in to"
	;;
*)
	echo "demo: the sim driver has no guest to log in to: skipped"
	;;
esac

step "the control API's view: hosts and VMs"
curl -fsS -H "Authorization: Bearer $token" "http://$listen/v1/hosts" | head -c 4000; echo
curl -fsS -H "Authorization: Bearer $token" "http://$listen/v1/vms" | head -c 4000; echo

step "terraform plan after apply (expect no changes)"
terraform plan -input=false -detailed-exitcode "${tfvars[@]}"

step "terraform destroy"
terraform destroy -auto-approve -input=false "${tfvars[@]}"
if [[ -n "$fallback" ]]; then
	echo "demo: done on the sim driver (FALLBACK: $fallback)"
else
	echo "demo: done with real QEMU guests"
fi
