#!/usr/bin/env bash
# build-tofu.sh BIN_DIR: build the OpenTofu CLI (TOFU_VERSION) into BIN_DIR/tofu
# from its Go module, for the provider acceptance tests under OpenTofu.
#
# `go install github.com/opentofu/opentofu/cmd/tofu@v...` refuses the module
# because its go.mod has replace directives, so this downloads the module
# (`go mod download -json` prints its folder in the module cache) and runs
# `go build ./cmd/tofu` in that folder as the main module. The folder is
# read-only and its go.sum is complete, so the build runs with
# -mod=readonly and writes nothing there.
#
# A build takes about 5 minutes on 2 cores with a cold module cache and about
# 1 minute with a warm one, so the binary is kept in a cache outside the
# checkout (KVM_TOFU_CACHE, default ~/.cache/kvmfleet/tofu), keyed by the
# version and this script's own sha256: a rerun copies the cached binary.
set -euo pipefail

TOFU_VERSION=${TOFU_VERSION:-1.12.6}
MODULE=github.com/opentofu/opentofu

out=${1:?usage: build-tofu.sh BIN_DIR}
log() { printf 'build-tofu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v go >/dev/null || die "go not found: OpenTofu $TOFU_VERSION builds with the Go toolchain its go.mod asks for"
mkdir -p "$out"
out=$(cd "$out" && pwd)

script_sha=$(sha256sum "$0" | cut -c1-16)
cache_root=${KVM_TOFU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmfleet/tofu}
cached="$cache_root/tofu-$TOFU_VERSION-$script_sha"

# version_of BIN: the "OpenTofu vX.Y.Z" line of `BIN version`. The whole
# output is read first: grep -q would close the pipe early, and tofu, still
# writing, would die of SIGPIPE. (tofu prints a warning about a missing CLI
# configuration file on stdout too.)
version_of() {
	local out
	out=$(CHECKPOINT_DISABLE=1 "$1" version 2>/dev/null) || return 0
	printf '%s\n' "$out" | sed -n 's/^\(OpenTofu v[^ ]*\)$/\1/p'
}

work=
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
build() {
	local json dir
	work=$(mktemp -d "$cache_root/.build-tofu.XXXXXX")
	log "go mod download $MODULE@v$TOFU_VERSION"
	# Outside any module, so the checkout's go.mod plays no part.
	json=$(cd "$work" && GOFLAGS= go mod download -json "$MODULE@v$TOFU_VERSION") ||
		die "go mod download $MODULE@v$TOFU_VERSION failed: $json"
	dir=$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
	[ -n "$dir" ] && [ -f "$dir/go.mod" ] || die "go mod download printed no module folder: $json"

	log "go build ./cmd/tofu in $dir (about 5 minutes cold, 1 minute with the module cache warm)"
	# version.dev=no is what OpenTofu's release builds set: `tofu version`
	# then prints v$TOFU_VERSION without a -dev suffix.
	(cd "$dir" && GOFLAGS=-mod=readonly GOWORK=off go build -trimpath \
		-ldflags "-s -w -X $MODULE/version.dev=no" -o "$work/tofu" ./cmd/tofu) ||
		die "go build ./cmd/tofu in $dir failed"
	local said
	said=$(version_of "$work/tofu")
	[ "$said" = "OpenTofu v$TOFU_VERSION" ] || die "the built tofu says ${said:-nothing} for its version, not OpenTofu v$TOFU_VERSION"
	rm -rf "$cached"
	mkdir -p "$cached"
	mv "$work/tofu" "$cached/tofu"
	log "cached $cached/tofu"
}

# One build at a time per cache (a CI step and a developer's make may race).
mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9
if [ ! -x "$cached/tofu" ]; then
	build
fi
flock -u 9
cp "$cached/tofu" "$out/tofu.tmp"
mv "$out/tofu.tmp" "$out/tofu"
log "$out/tofu: $(version_of "$out/tofu")"
