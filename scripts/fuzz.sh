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

# run_target fuzzes one target. Go's fuzzing engine sometimes ends a run
# with "context deadline exceeded" when a worker is still busy with an input
# as the time runs out; that is the engine stopping, not a finding (a real
# finding writes its input under testdata/fuzz). Such a run is tried once
# more; a second engine stop is reported and not counted as a failure.
run_target() {
	local pkg="$1" target="$2" out attempt
	for attempt in 1 2; do
		out="$(mktemp)"
		if go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg" 2>&1 | tee "$out"; then
			rm -f "$out"
			return 0
		fi
		if grep -q 'Failing input written' "$out" || ! grep -q 'context deadline exceeded' "$out"; then
			rm -f "$out"
			return 1
		fi
		rm -f "$out"
		echo "fuzz: $pkg $target: the engine stopped a busy worker at the deadline (no failing input); attempt $attempt"
	done
	echo "fuzz: $pkg $target: stopped at the deadline twice without a failing input; not counted as a finding"
	return 0
}

failed=()
for pkg in "${pkgs[@]}"; do
	[[ "$pkg" == ./* ]] || pkg="./$pkg"
	mapfile -t targets < <(go test -list '^Fuzz' "$pkg" | grep '^Fuzz' || true)
	for target in "${targets[@]}"; do
		echo "== $pkg $target ($FUZZTIME)"
		if ! run_target "$pkg" "$target"; then
			failed+=("$pkg $target")
		fi
	done
done

if [ "${#failed[@]}" -gt 0 ]; then
	printf 'fuzz: failed: %s\n' "${failed[@]}" >&2
	exit 1
fi
echo "fuzz: every target ran $FUZZTIME without a failure"
