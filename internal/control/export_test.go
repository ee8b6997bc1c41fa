package control

// UseSimMigrationsForTest is UseSimMigrations for the external tests.
var UseSimMigrationsForTest = UseSimMigrations
