#!/usr/bin/env bash
# check-ops.sh: check the operator files the repository ships.
#   - scripts/monitoring/kvmd-alerts.yml passes `promtool check rules` and
#     its unit tests (`promtool test rules kvmd-alerts.test.yml`);
#   - scripts/monitoring/grafana-dashboard.json is JSON;
#   - every kvmd_* and kvm_* metric the rules' and the dashboard's
#     expressions use is exported by a running kvmd (control API and agent
#     of `kvmd dev --driver sim`, with a project that has a quota);
#   - scripts/systemd/*.service pass `systemd-analyze verify` (in a scratch
#     root holding the system's units and a stand-in /usr/local/bin/kvmd)
#     with no warning at all.
# A missing promtool or systemd-analyze fails the check; scripts/deps.sh ci
# installs both.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BIN:-$root/bin}"
work="$(mktemp -d)"
kvmd_pid=""
cleanup() {
	if [[ -n "$kvmd_pid" ]] && kill -0 "$kvmd_pid" 2>/dev/null; then
		kill "$kvmd_pid"
		wait "$kvmd_pid" 2>/dev/null || true
	fi
	rm -rf "$work"
}
trap cleanup EXIT
fail() { printf 'check-ops: FAIL: %s\n' "$*" >&2; exit 1; }
for tool in promtool systemd-analyze python3 curl; do
	command -v "$tool" >/dev/null || fail "$tool is not on PATH: run scripts/deps.sh ci (as root) or install it"
done
mon="$root/scripts/monitoring"

echo "check-ops: promtool check rules"
promtool check rules "$mon/kvmd-alerts.yml"
echo "check-ops: promtool test rules (the alerts fire on the cases in kvmd-alerts.test.yml)"
(cd "$mon" && promtool test rules kvmd-alerts.test.yml)
python3 -m json.tool "$mon/grafana-dashboard.json" >/dev/null || fail "grafana-dashboard.json is not valid JSON"

echo "check-ops: the metrics the rules and the dashboard use exist"
[ -x "$bin/kvmd" ] || fail "$bin/kvmd is missing: run make build"
listen="127.0.0.1:$((20000 + RANDOM % 20000))"
KVMD_TOKEN=check-ops "$bin/kvmd" dev --driver sim --listen "$listen" --data-dir "$work/dev" >/dev/null 2>"$work/kvmd.log" &
kvmd_pid=$!
for _ in $(seq 60); do
	curl -fsS "http://$listen/readyz" >/dev/null 2>&1 && break
	kill -0 "$kvmd_pid" 2>/dev/null || { cat "$work/kvmd.log" >&2; fail "kvmd dev exited"; }
	sleep 0.5
done
agent=""
for _ in $(seq 20); do
	agent=$(sed -n 's/.*local agent "local" on \([0-9.:]*\) with.*/\1/p' "$work/kvmd.log")
	[ -n "$agent" ] && break
	sleep 0.5
done
[ -n "$agent" ] || { cat "$work/kvmd.log" >&2; fail "kvmd dev did not say where its agent listens"; }
# The project series exist once a project has a quota: make one.
curl -fsS -o /dev/null -H "Authorization: Bearer check-ops" -H "Content-Type: application/json" \
	-d '{"name":"check-ops","quotas":{"vcpus":4}}' "http://$listen/v1/projects" ||
	fail "POST /v1/projects to kvmd dev failed (see $work/kvmd.log)"
{
	curl -fsS "http://$listen/metrics"
	curl -fsS "http://$agent/metrics"
} | grep -oE '^kvmd?_[a-z_]*' | sort -u >"$work/exported"
# The metric names of the expressions: the rules' expr blocks and the
# dashboard's "expr" fields (their prose names Terraform's kvm_* resources).
{
	awk '/^[[:space:]]*expr:/ { e = 1; print; next }
		e && /^[[:space:]]*(for|keep_firing_for|labels|annotations):/ { e = 0 }
		e' "$mon/kvmd-alerts.yml"
	grep '"expr"' "$mon/grafana-dashboard.json"
} | grep -oE '\bkvmd?_[a-z_]*' | sed -E 's/_(bucket|count|sum)$//' | sort -u >"$work/used"
missing=$(comm -23 "$work/used" <(sed -E 's/_(bucket|count|sum)$//' "$work/exported" | sort -u))
[ -z "$missing" ] || fail "used by the rules or the dashboard but not exported: $missing"
echo "check-ops: $(wc -l <"$work/used") metrics used, all exported"

echo "check-ops: systemd-analyze verify"
sysroot="$work/root"
mkdir -p "$sysroot/usr/local/bin" "$sysroot/etc/systemd/system" "$sysroot/usr/lib/systemd"
cp -a /usr/lib/systemd/system "$sysroot/usr/lib/systemd/"
cp "$bin/kvmd" "$sysroot/usr/local/bin/kvmd"
cp "$root"/scripts/systemd/*.service "$sysroot/etc/systemd/system/"
units=()
for u in "$root"/scripts/systemd/*.service; do units+=("${u##*/}"); done
out=$(cd "$sysroot/etc/systemd/system" && systemd-analyze verify --root="$sysroot" "${units[@]}" 2>&1) ||
	fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify warns: $out"
echo "check-ops: ok (${units[*]} verified)"
