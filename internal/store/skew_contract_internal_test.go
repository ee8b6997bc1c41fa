package store

import (
	"regexp"
	"strings"
	"testing"
)

// skewContractAllowed lists the migration statements that contract the
// schema (drop or rename what a release reads), each with the release that
// may run it. Under the version skew contract (internal/version, the
// operating guide's "Upgrades") control replicas of release N and N+1 share
// one database during a rolling upgrade, so a migration only adds what
// release N ignores; a contraction lands only in a release whose previous
// release no longer reads the object. The two below predate the contract:
// they shipped in 0.1.0, whose upgrades stopped every replica.
var skewContractAllowed = map[string]string{
	"0013_idempotency_scope.sql: DROP TABLE idempotency_keys":                                    "0.1.0 (before the skew contract)",
	"0013_idempotency_scope.sql: ALTER TABLE idempotency_keys_scoped RENAME TO idempotency_keys": "0.1.0 (before the skew contract)",
	"0013_idempotency_scope.sql: DROP INDEX forks_idempotency_key":                               "0.1.0 (before the skew contract)",
	"0014_projects.sql: DROP INDEX vms_name":                                                     "0.1.0 (before the skew contract)",
}

// contracting says why a statement contracts the schema ("" when it only
// expands): what a replica of the release before may still read or write
// is dropped or renamed, a column's type or nullability changes, or a NOT
// NULL column comes without a default (the release before inserts rows
// without it).
func contracting(stmt string) string {
	for _, r := range []struct {
		why string
		re  *regexp.Regexp
	}{
		{"drops an object", regexp.MustCompile(`(?i)^DROP\s`)},
		{"drops a column or constraint", regexp.MustCompile(`(?i)\bALTER\s+TABLE\b.*\bDROP\b`)},
		{"renames", regexp.MustCompile(`(?i)\bRENAME\b`)},
		{"changes a column", regexp.MustCompile(`(?i)\bALTER\s+COLUMN\b`)},
	} {
		if r.re.MatchString(stmt) {
			return r.why
		}
	}
	for _, col := range addColumn.Split(stmt, -1)[1:] {
		if notNull.MatchString(col) && !hasDefault.MatchString(col) {
			return "adds a NOT NULL column without a default"
		}
	}
	return ""
}

var (
	addColumn  = regexp.MustCompile(`(?i)\bADD\s+COLUMN\b`)
	notNull    = regexp.MustCompile(`(?i)\bNOT\s+NULL\b`)
	hasDefault = regexp.MustCompile(`(?i)\bDEFAULT\b`)
)

// TestMigrationsOnlyExpand checks every migration file, statement by
// statement: one that contracts the schema must be on the allow-list with
// the release that may run it. It fails on a new DROP or RENAME.
func TestMigrationsOnlyExpand(t *testing.T) {
	all, err := migrations()
	if err != nil {
		t.Fatal(err)
	}
	used := map[string]bool{}
	for _, m := range all {
		for _, stmt := range splitStatements(m.sql) {
			one := strings.Join(strings.Fields(stmt), " ")
			why := contracting(one)
			if why == "" {
				continue
			}
			key := m.name + ": " + one
			if _, ok := skewContractAllowed[key]; ok {
				used[key] = true
				continue
			}
			t.Errorf("migration %s %s: %q\n"+
				"a replica of the release before still reads it during a rolling upgrade: add what is new, and drop "+
				"the old in a later release (then list the statement in skewContractAllowed with that release)", m.name, why, one)
		}
	}
	for key := range skewContractAllowed {
		if !used[key] {
			t.Errorf("skewContractAllowed lists %q, which no migration runs: remove it", key)
		}
	}
}

// TestMigrationContractingRules pins what the expand-only check refuses
// and what it lets through.
func TestMigrationContractingRules(t *testing.T) {
	for stmt, contracts := range map[string]bool{
		"DROP TABLE vms":                                        true,
		"DROP INDEX vms_name":                                   true,
		"ALTER TABLE vms DROP COLUMN name":                      true,
		"ALTER TABLE vms RENAME COLUMN name TO label":           true,
		"ALTER TABLE vms ALTER COLUMN name TYPE BIGINT":         true,
		"ALTER TABLE vms ADD COLUMN x TEXT NOT NULL":            true,
		"ALTER TABLE vms ADD COLUMN x TEXT NOT NULL DEFAULT ''": false,
		"ALTER TABLE vms ADD COLUMN x TEXT NULL":                false,
		"CREATE TABLE t (a TEXT NOT NULL)":                      false,
		"CREATE INDEX vms_x ON vms (x)":                         false,
		"UPDATE vms SET x = name":                               false,
	} {
		if got := contracting(stmt) != ""; got != contracts {
			t.Errorf("contracting(%q) = %q, want contracting %v", stmt, contracting(stmt), contracts)
		}
	}
}
