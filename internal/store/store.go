// Package store is the control API's database: gorm models and queries over
// versioned SQL migrations, on embedded SQLite (default) or PostgreSQL. It
// translates database errors into the errors below once; callers never see
// a driver error they would have to interpret.
package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/glebarez/sqlite"
	"github.com/jackc/pgx/v5/pgconn"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// Errors of the store; test them with errors.Is.
var (
	ErrNotFound      = errors.New("not found")
	ErrDuplicateName = errors.New("name already taken")
	ErrNoRoom        = errors.New("host has no room for the request")
	// ErrGroupCap: the VM's group already holds max_per_domain VMs in the
	// host's domain.
	ErrGroupCap      = errors.New("the group is at its cap in this domain")
	ErrHostInUse     = errors.New("host still has VMs")
	ErrAgentKeyTaken = errors.New("agent identity key already pinned to another host")
	// ErrHostRetired: the host was retired (its agent is gone for good).
	ErrHostRetired = errors.New("host is retired")
)

// Dialects.
const (
	DialectSQLite   = "sqlite"
	DialectPostgres = "postgres"
)

// Config says which database to open.
type Config struct {
	// DatabaseURL selects PostgreSQL (postgres://...). Empty means SQLite.
	DatabaseURL string
	// DataDir holds the SQLite file kvmd.db when DatabaseURL is empty.
	DataDir string
	// SQLiteFullSync makes SQLite fsync every commit (see sqliteDSN).
	SQLiteFullSync bool
	// MaxConns bounds the PostgreSQL connection pool (default 16).
	MaxConns int
	Logger   *slog.Logger
}

// Store is the database of the control API.
type Store struct {
	db      *gorm.DB
	dialect string
	log     *slog.Logger
	batcher *reservationBatcher
	// leases are the quota lease books of the PostgreSQL committers, one
	// each (quota_leases.go); nil on SQLite.
	leases []*leaseBook
	// statements counts the SQL statements issued through gorm (Statements).
	statements atomic.Int64
}

// Open connects, applies pending migrations and returns the store.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	gcfg := &gorm.Config{
		TranslateError: true,
		Logger:         logger.Default.LogMode(logger.Silent),
		// Writes that need a transaction open one explicitly.
		SkipDefaultTransaction: true,
	}
	var (
		db      *gorm.DB
		dialect string
		err     error
	)
	if cfg.DatabaseURL != "" {
		dialect = DialectPostgres
		db, err = gorm.Open(postgres.Open(cfg.DatabaseURL), gcfg)
		if err != nil {
			// The DSN may hold a password: name the database kind, not the URL.
			return nil, fmt.Errorf("open PostgreSQL database: %w", redactErr(err, cfg.DatabaseURL))
		}
	} else {
		dialect = DialectSQLite
		if cfg.DataDir == "" {
			return nil, errors.New("open SQLite database: no data directory given (--data-dir)")
		}
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("create data directory: %w", err)
		}
		db, err = gorm.Open(sqlite.Open(sqliteDSN(filepath.Join(cfg.DataDir, "kvmd.db"), cfg.SQLiteFullSync)), gcfg)
		if err != nil {
			return nil, fmt.Errorf("open SQLite database in %s: %w", cfg.DataDir, err)
		}
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, fmt.Errorf("open %s database: %w", dialect, err)
	}
	if dialect == DialectSQLite {
		// One connection: SQLite has one writer anyway, and a single
		// connection never meets SQLITE_BUSY inside this process.
		sqlDB.SetMaxOpenConns(1)
	} else {
		n := cfg.MaxConns
		if n <= 0 {
			n = 16
		}
		sqlDB.SetMaxOpenConns(n)
		sqlDB.SetMaxIdleConns(n)
	}
	s := &Store{db: db, dialect: dialect, log: log}
	if err := s.countStatements(); err != nil {
		_ = sqlDB.Close()
		return nil, err
	}
	if err := s.Ping(ctx); err != nil {
		_ = sqlDB.Close()
		return nil, err
	}
	if err := s.migrate(ctx); err != nil {
		_ = sqlDB.Close()
		return nil, err
	}
	if dialect == DialectSQLite {
		s.batcher = newReservationBatcher(db, 1, nil)
	} else {
		s.leases = newLeaseBooks(postgresCommitters)
		s.batcher = newReservationBatcher(db, postgresCommitters, s.commitPostgres)
	}
	return s, nil
}

// sqliteDSN turns on WAL (readers never block the writer), a busy timeout
// for other processes on the same file, foreign keys, and BEGIN IMMEDIATE so
// that a transaction takes the write lock up front instead of failing when
// it upgrades. synchronous=NORMAL is SQLite's advice for WAL: a commit
// survives a crash of the process and the database never corrupts, but a
// power loss may roll back the last commits; in exchange a commit costs no
// fsync (BenchmarkReservationOnly in bench/ compares the two). temp_store
// keeps savepoint journals in memory. fullSync asks for an fsync per commit.
func sqliteDSN(path string, fullSync bool) string {
	sync := "NORMAL"
	if fullSync {
		sync = "FULL"
	}
	return "file:" + path + "?_pragma=journal_mode(WAL)&_pragma=busy_timeout(10000)" +
		"&_pragma=foreign_keys(1)&_pragma=synchronous(" + sync + ")&_pragma=temp_store(MEMORY)&_txlock=immediate"
}

// countStatements registers a gorm callback on every kind of statement.
func (s *Store) countStatements() error {
	count := func(*gorm.DB) { s.statements.Add(1) }
	cb := s.db.Callback()
	for _, err := range []error{
		cb.Create().Register("kvmd:count_statements", count),
		cb.Query().Register("kvmd:count_statements", count),
		cb.Update().Register("kvmd:count_statements", count),
		cb.Delete().Register("kvmd:count_statements", count),
		cb.Row().Register("kvmd:count_statements", count),
		cb.Raw().Register("kvmd:count_statements", count),
	} {
		if err != nil {
			return fmt.Errorf("register statement counter: %w", err)
		}
	}
	return nil
}

// Statements is the number of SQL statements this store has issued (not
// counting BEGIN and COMMIT): tests use it to prove that a path issues
// none, or a bounded number.
func (s *Store) Statements() int64 { return s.statements.Load() }

// Dialect is DialectSQLite or DialectPostgres.
func (s *Store) Dialect() string { return s.dialect }

// Close stops the reservation batcher and closes the database.
func (s *Store) Close() error {
	if s.batcher != nil {
		s.batcher.close()
	}
	if s.leases != nil {
		s.returnLeases(s.leases)
	}
	sqlDB, err := s.db.DB()
	if err != nil {
		return err
	}
	return sqlDB.Close()
}

// Ping checks that the database answers (the readiness probe).
func (s *Store) Ping(ctx context.Context) error {
	sqlDB, err := s.db.DB()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := sqlDB.PingContext(ctx); err != nil {
		return fmt.Errorf("%s database does not answer: %w", s.dialect, err)
	}
	return nil
}

// inTx runs fn in a transaction and retries it when the database reports a
// serialization failure or deadlock (SQLSTATE 40001, 40P01), as
// PostgreSQL-compatible distributed databases ask clients to do.
func (s *Store) inTx(ctx context.Context, fn func(tx *gorm.DB) error) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		err = s.db.WithContext(ctx).Transaction(fn)
		if !retryable(err) || ctx.Err() != nil {
			return err
		}
		time.Sleep(time.Duration(attempt+1) * 5 * time.Millisecond)
	}
	return err
}

func retryable(err error) bool {
	code := pgCode(err)
	return code == "40001" || code == "40P01"
}

// isDuplicate and isForeignKey also look at PostgreSQL's SQLSTATE: gorm
// does not translate errors of raw queries read with Scan.
func isDuplicate(err error) bool {
	return errors.Is(err, gorm.ErrDuplicatedKey) || pgCode(err) == "23505"
}

func isForeignKey(err error) bool {
	return errors.Is(err, gorm.ErrForeignKeyViolated) || pgCode(err) == "23503"
}

// pgConstraint is the constraint a PostgreSQL error names ("" otherwise).
func pgConstraint(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.ConstraintName
	}
	return ""
}

func pgDetail(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Detail
	}
	return ""
}

func pgCode(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// redactErr removes a DSN (and so its password) from a driver error.
func redactErr(err error, dsn string) error {
	msg := err.Error()
	if dsn != "" && strings.Contains(msg, dsn) {
		msg = strings.ReplaceAll(msg, dsn, "<database-url>")
		return errors.New(msg)
	}
	return err
}

func now() time.Time { return time.Now().UTC() }
