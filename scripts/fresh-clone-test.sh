#!/usr/bin/env bash
# fresh-clone-test.sh: the README's two commands in a fresh clone of HEAD, in
# an environment without QEMU: PATH holds every tool of this machine except
# qemu-*, the image cache is an empty directory, HOME is empty, and
# KVM_DEPS_INSTALL=no stands for a user who cannot install packages. It checks
# that
#   - make demo prints the apt-get command, says "demo: FALLBACK to the sim
#     driver" and still applies and destroys examples/quickstart on the sim
#     driver;
#   - make test's preparation says the real-QEMU tests will skip, and those
#     tests do skip with their message (the qemu package's tests, as a sample).
# Go's module and build caches are shared with this machine (they hold no
# state of the product, only compiled code).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { printf 'fresh-clone-test: FAIL: %s\n' "$*" >&2; exit 1; }

git clone --quiet "$root" "$work/repo"
mkdir -p "$work/bin" "$work/home" "$work/images"
# Every command of this machine except QEMU's.
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
	[ -d "$d" ] || continue
	for f in "$d"/*; do
		b=${f##*/}
		case "$b" in qemu-*) continue ;; esac
		[ -e "$work/bin/$b" ] || ln -s "$f" "$work/bin/$b"
	done
done
[ ! -e "$work/bin/qemu-system-x86_64" ] || fail "qemu-system-x86_64 is still on the filtered PATH"

clean_env=(env -i "PATH=$work/bin" "HOME=$work/home" "KVM_IMAGE_DIR=$work/images" KVM_DEPS_INSTALL=no
	"GOMODCACHE=$(go env GOMODCACHE)" "GOCACHE=$(go env GOCACHE)" "GOPROXY=$(go env GOPROXY)"
	"KVM_DEMO_LISTEN=127.0.0.1:$((20000 + RANDOM % 20000))" TERM=dumb)

echo "fresh-clone-test: make demo in $work/repo without QEMU"
start=$(date +%s)
if ! "${clean_env[@]}" make -C "$work/repo" demo >"$work/demo.log" 2>&1; then
	cat "$work/demo.log" >&2
	fail "make demo failed without QEMU"
fi
echo "fresh-clone-test: make demo took $(($(date +%s) - start)) s"
for want in "apt-get install -y --no-install-recommends" "qemu-system-x86" \
	"demo: FALLBACK to the sim driver: Debian packages are missing" \
	"kvm_vm.demo[0]: Creation complete" "kvm_vm.guest: Creation complete" \
	"demo: the sim driver has no guest to log in to: skipped" "Destroy complete!" "demo: done on the sim driver"; do
	grep -qF -- "$want" "$work/demo.log" || { cat "$work/demo.log" >&2; fail "make demo output lacks: $want"; }
done
[ -z "$(ls -A "$work/images")" ] || fail "make demo wrote into the image cache although it fell back"
grep -F "demo: FALLBACK" "$work/demo.log"

echo "fresh-clone-test: make test's preparation and the real-QEMU tests without QEMU"
"${clean_env[@]}" make -C "$work/repo" test-deps >"$work/test-deps.log" 2>&1 || { cat "$work/test-deps.log" >&2; fail "make test-deps failed"; }
grep -qF "make test: QEMU is not installed: the tests that run real QEMU guests will SKIP" "$work/test-deps.log" ||
	{ cat "$work/test-deps.log" >&2; fail "make test-deps does not say that the QEMU tests skip"; }
(cd "$work/repo" && "${clean_env[@]}" go test -count=1 -v ./internal/agent/qemu/ >"$work/qemu-test.log" 2>&1) ||
	{ cat "$work/qemu-test.log" >&2; fail "the qemu package's tests fail without QEMU instead of skipping"; }
grep -qF "qemu-system-x86_64 is not on PATH, so this real-QEMU test skips" "$work/qemu-test.log" ||
	{ cat "$work/qemu-test.log" >&2; fail "no skip message in the qemu package's tests"; }
! grep -q -- "--- FAIL" "$work/qemu-test.log" || fail "a qemu package test failed"
echo "fresh-clone-test: ok ($(grep -c -- '--- SKIP' "$work/qemu-test.log") real-QEMU tests of the qemu package skipped with their message)"
