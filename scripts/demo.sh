#!/usr/bin/env bash
# The quickstart, end to end on the embedded default: kvmd dev (control API on
# SQLite + one local agent), terraform apply of examples/quickstart with the
# locally built provider (dev_overrides), a look at what it made, then destroy.
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
terraform apply -auto-approve -input=false -var "image=$image"

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

step "the control API's view: hosts and VMs"
curl -fsS -H "Authorization: Bearer $token" "http://$listen/v1/hosts" | head -c 4000; echo
curl -fsS -H "Authorization: Bearer $token" "http://$listen/v1/vms" | head -c 4000; echo

step "terraform plan after apply (expect no changes)"
terraform plan -input=false -detailed-exitcode -var "image=$image"

step "terraform destroy"
terraform destroy -auto-approve -input=false -var "image=$image"
if [[ -n "$fallback" ]]; then
	echo "demo: done on the sim driver (FALLBACK: $fallback)"
else
	echo "demo: done with real QEMU guests"
fi
