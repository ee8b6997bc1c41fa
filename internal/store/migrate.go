package store

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"

	"gorm.io/gorm"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

type migration struct {
	version int
	name    string
	sql     string
}

// migrations returns the embedded migrations in version order. A file is
// named NNNN_what.sql; versions are unique and only ever appended.
func migrations() ([]migration, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	var out []migration
	for _, e := range entries {
		prefix, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(prefix)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration %s: name must start with a number and an underscore", e.Name())
		}
		b, err := migrationFiles.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, err
		}
		out = append(out, migration{version: v, name: e.Name(), sql: string(b)})
	}
	slices.SortFunc(out, func(a, b migration) int { return a.version - b.version })
	for i := 1; i < len(out); i++ {
		if out[i].version == out[i-1].version {
			return nil, fmt.Errorf("migrations %s and %s share version %d", out[i-1].name, out[i].name, out[i].version)
		}
	}
	return out, nil
}

// migrate applies the pending migrations in one transaction and records
// each in schema_migrations. On PostgreSQL an advisory lock makes replicas
// that start together apply them once; SQLite's BEGIN IMMEDIATE does the
// same for processes sharing a file.
func (s *Store) migrate(ctx context.Context) error {
	all, err := migrations()
	if err != nil {
		return err
	}
	err = s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if s.dialect == DialectPostgres {
			if err := tx.Exec("SELECT pg_advisory_xact_lock(72540101)").Error; err != nil {
				return fmt.Errorf("lock for migrations: %w", err)
			}
		}
		if err := tx.Exec(`CREATE TABLE IF NOT EXISTS schema_migrations (
			version    BIGINT PRIMARY KEY,
			name       TEXT NOT NULL,
			applied_at TIMESTAMP NOT NULL)`).Error; err != nil {
			return fmt.Errorf("create schema_migrations: %w", err)
		}
		var applied []int
		if err := tx.Raw("SELECT version FROM schema_migrations").Scan(&applied).Error; err != nil {
			return fmt.Errorf("read schema_migrations: %w", err)
		}
		for _, m := range all {
			if slices.Contains(applied, m.version) {
				continue
			}
			for _, stmt := range splitStatements(m.sql) {
				if err := tx.Exec(stmt).Error; err != nil {
					return fmt.Errorf("migration %s: %w", m.name, err)
				}
			}
			if err := tx.Exec("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
				m.version, m.name, now()).Error; err != nil {
				return fmt.Errorf("record migration %s: %w", m.name, err)
			}
			s.log.Info("applied migration", "migration", m.name, "dialect", s.dialect)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("migrate %s database: %w", s.dialect, err)
	}
	return nil
}

// AppliedMigrations lists the versions recorded in schema_migrations.
func (s *Store) AppliedMigrations(ctx context.Context) ([]int, error) {
	var v []int
	err := s.db.WithContext(ctx).Raw("SELECT version FROM schema_migrations ORDER BY version").Scan(&v).Error
	return v, err
}

// splitStatements splits a migration on semicolons at line ends, after
// dropping "--" comments. Migrations keep one statement per semicolon and
// no semicolons inside strings.
func splitStatements(sql string) []string {
	var b strings.Builder
	for line := range strings.Lines(sql) {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i] + "\n"
		}
		b.WriteString(line)
	}
	var out []string
	for stmt := range strings.SplitSeq(b.String(), ";") {
		if stmt = strings.TrimSpace(stmt); stmt != "" {
			out = append(out, stmt)
		}
	}
	return out
}
