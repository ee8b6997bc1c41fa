package store

import (
	"context"
	"fmt"
)

// SQLite sync modes (--sqlite-sync).
const (
	// SQLiteSyncFull fsyncs the WAL at every commit: an acknowledged write
	// survives a power loss. The default.
	SQLiteSyncFull = "full"
	// SQLiteSyncNormal fsyncs only at checkpoints: a commit survives a crash
	// of the process, but a power loss may roll back the last commits,
	// acknowledged creates included.
	SQLiteSyncNormal = "normal"
)

// ParseSQLiteSync checks a --sqlite-sync value and reports whether it asks
// for an fsync per commit (Config.SQLiteFullSync).
func ParseSQLiteSync(mode string) (fullSync bool, err error) {
	switch mode {
	case SQLiteSyncFull, "":
		return true, nil
	case SQLiteSyncNormal:
		return false, nil
	}
	return false, fmt.Errorf("--sqlite-sync %q: want %s (every commit survives a power loss) or %s (faster; a power loss may roll back the last acknowledged writes)",
		mode, SQLiteSyncFull, SQLiteSyncNormal)
}

// SQLiteSync reports the synchronous setting the SQLite connection runs
// with ("full", "normal", ...), read from the database itself; "" on
// PostgreSQL.
func (s *Store) SQLiteSync(ctx context.Context) (string, error) {
	if s.dialect != DialectSQLite {
		return "", nil
	}
	var level int
	if err := s.db.WithContext(ctx).Raw("PRAGMA synchronous").Scan(&level).Error; err != nil {
		return "", fmt.Errorf("read PRAGMA synchronous: %w", err)
	}
	switch level {
	case 0:
		return "off", nil
	case 1:
		return SQLiteSyncNormal, nil
	case 2:
		return SQLiteSyncFull, nil
	case 3:
		return "extra", nil
	}
	return fmt.Sprint(level), nil
}
