package store

import "database/sql"

// MigrationVersions lists the versions of the embedded migrations (for tests).
func MigrationVersions() ([]int, error) {
	all, err := migrations()
	if err != nil {
		return nil, err
	}
	var v []int
	for _, m := range all {
		v = append(v, m.version)
	}
	return v, nil
}

// SQLDB is the store's connection pool (for tests that hold a transaction
// open across store calls).
func (s *Store) SQLDB() (*sql.DB, error) { return s.db.DB() }
