#!/usr/bin/env bash
# release.sh VERSION DIST: build a release into DIST (emptied first).
#
#   terraform-provider-kvm_<v>_linux_{amd64,arm64}.zip   each holding terraform-provider-kvm_v<v>
#   terraform-provider-kvm_<v>_manifest.json             the registry manifest (protocol 6.0)
#   terraform-provider-kvm_<v>_SHA256SUMS                checksums of the zips and the manifest
#   kvmd_<v>_linux_{amd64,arm64}.tar.gz                  kvmd, the systemd units and env files,
#                                                        the alert rules and the dashboard
#   kvmd_<v>_SHA256SUMS                                  checksums of the tarballs
#   mirror/registry.terraform.io/kvmfleet/kvm/<zips>     a filesystem mirror (packed layout) for
#   mirror/registry.opentofu.org/kvmfleet/kvm/<zips>     Terraform and for OpenTofu
#
# The zip layout and names are what the Terraform registry and a filesystem
# mirror expect. VERSION is semver without a leading v; Terraform selects a
# pre-release (0.2.0-rc1) only with an exact version constraint.
set -euo pipefail
version=${1:?usage: release.sh VERSION DIST}
dist=${2:?usage: release.sh VERSION DIST}
root="$(cd "$(dirname "$0")/.." && pwd)"
log() { printf 'release: %s\n' "$*" >&2; }

[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
	{ log "error: version $version is not semver like 1.2.3 (no leading v)"; exit 1; }
[[ "$version" != *-* ]] || log "note: $version is a pre-release: Terraform selects it only with version = \"$version\""
for tool in go zip sha256sum tar; do
	command -v "$tool" >/dev/null || { log "error: $tool is not on PATH"; exit 1; }
done

rm -rf "$dist"
mkdir -p "$dist"
dist="$(cd "$dist" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
provider=terraform-provider-kvm
ldflags="-s -w -X main.version=$version -X github.com/kvmfleet/terraform-provider-kvm/internal/version.release=$version"
# Reproducible archives: fixed times and owners.
stamp=$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)

# RELEASE_PLATFORMS narrows the build (the release test builds only the
# machine's own platform).
for platform in ${RELEASE_PLATFORMS:-linux/amd64 linux/arm64}; do
	os=${platform%/*} arch=${platform#*/}
	log "building $os/$arch"
	out="$work/$os-$arch"
	mkdir -p "$out/kvmd"
	(cd "$root" && CGO_ENABLED=0 GOOS=$os GOARCH=$arch go build -trimpath -ldflags "$ldflags" \
		-o "$out/${provider}_v$version" ./provider)
	(cd "$root" && CGO_ENABLED=0 GOOS=$os GOARCH=$arch go build -trimpath -ldflags "$ldflags" \
		-o "$out/kvmd/kvmd" ./server)
	touch -d "@$stamp" "$out/${provider}_v$version"
	(cd "$out" && zip -q -X "$dist/${provider}_${version}_${os}_${arch}.zip" "${provider}_v$version")

	mkdir -p "$out/kvmd/systemd" "$out/kvmd/monitoring"
	cp "$root"/scripts/systemd/* "$out/kvmd/systemd/"
	cp "$root"/scripts/monitoring/* "$out/kvmd/monitoring/"
	cp "$root/README.md" "$out/kvmd/"
	tar -C "$out" --sort=name --mtime="@$stamp" --owner=0 --group=0 --numeric-owner \
		-czf "$dist/kvmd_${version}_${os}_${arch}.tar.gz" kvmd
done
cp "$root/terraform-registry-manifest.json" "$dist/${provider}_${version}_manifest.json"
(cd "$dist" && sha256sum "${provider}_${version}"_*.zip "${provider}_${version}_manifest.json" >"${provider}_${version}_SHA256SUMS")
(cd "$dist" && sha256sum kvmd_"${version}"_*.tar.gz >"kvmd_${version}_SHA256SUMS")

# A filesystem mirror in the packed layout, ready for provider_installation
# { filesystem_mirror { path = ".../mirror" } }. source = "kvmfleet/kvm"
# names registry.terraform.io/kvmfleet/kvm to Terraform and
# registry.opentofu.org/kvmfleet/kvm to OpenTofu: the mirror holds both.
for host in registry.terraform.io registry.opentofu.org; do
	mirror="$dist/mirror/$host/kvmfleet/kvm"
	mkdir -p "$mirror"
	cp "$dist/${provider}_${version}"_*.zip "$mirror/"
done
log "done: $dist"
ls -l "$dist" >&2
