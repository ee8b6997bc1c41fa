#!/bin/sh
# pgbench of the bare reservation on the real schema: 10,000 hosts,
# 8 clients, as one statement (reserve.pgbench) and as a transaction
# (reserve-tx.pgbench). ADMIN_URL is a PostgreSQL URL of a user that may
# create databases; the benchmark database is made and dropped here.
set -eu
ADMIN_URL=${ADMIN_URL:-${KVM_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}}
SECONDS_EACH=${SECONDS_EACH:-10}
here=$(cd "$(dirname "$0")" && pwd)
db=kvm_pgbench_$$
url=$(printf '%s' "$ADMIN_URL" | sed "s#/[^/?]*\(?\|\$\)#/$db\1#")
psql -Atq "$ADMIN_URL" -c "CREATE DATABASE $db"
trap 'psql -Atq "$ADMIN_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
for m in "$here"/../../internal/store/migrations/*.sql; do psql -Atq -v ON_ERROR_STOP=1 "$url" -f "$m" >/dev/null; done
psql -Atq -v ON_ERROR_STOP=1 "$url" -c "INSERT INTO hosts (name, address, schedulable, alive, cap_vcpus, cap_memory_mib, cap_disk_mib, created_at, updated_at)
	SELECT 'host-' || lpad(i::text, 5, '0'), '127.0.0.1:1', TRUE, TRUE, 1048576, 1099511627776, 1125899906842624, now(), now()
	FROM generate_series(0, 9999) AS i" -c "VACUUM ANALYZE"
for s in reserve reserve-tx; do
	printf '%s: ' "$s"
	pgbench -n -M prepared -c 8 -j 2 -T "$SECONDS_EACH" -f "$here/$s.pgbench" "$url" 2>&1 | grep -E '^tps' | sed 's/ (without initial connection time)//'
done
