#!/usr/bin/env bash
# Runs every Go fuzz target of the repository for FUZZTIME each (default
# 10s): `go test -fuzz` takes one target of one package at a time.
#   scripts/fuzz.sh                     every package with a Fuzz target
#   scripts/fuzz.sh ./internal/agent    only these packages
#   FUZZTIME=2m scripts/fuzz.sh         longer runs
# A failing input is written under the package's testdata/fuzz/<Target>/;
# commit it with the fix so that `go test` replays it from then on.
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZTIME="${FUZZTIME:-10s}"
if [ "$#" -gt 0 ]; then
	pkgs=("$@")
else
	mapfile -t pkgs < <(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u)
fi

failed=()
for pkg in "${pkgs[@]}"; do
	[[ "$pkg" == ./* ]] || pkg="./$pkg"
	mapfile -t targets < <(go test -list '^Fuzz' "$pkg" | grep '^Fuzz' || true)
	for target in "${targets[@]}"; do
		echo "== $pkg $target ($FUZZTIME)"
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg"; then
			failed+=("$pkg $target")
		fi
	done
done

if [ "${#failed[@]}" -gt 0 ]; then
	printf 'fuzz: failed: %s\n' "${failed[@]}" >&2
	exit 1
fi
echo "fuzz: every target ran $FUZZTIME without a failure"
