package ledger

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5" // registers the pgx5:// scheme
	"github.com/golang-migrate/migrate/v4/source/iofs"
)

//go:embed migrations/*.sql
var migrations embed.FS

// MigrationsTable is the table in which golang-migrate records the applied
// schema version.
const MigrationsTable = "idemcoord_schema_migrations"

// Migrate brings the database at databaseURL (a postgres:// URL) to the
// latest schema. It holds golang-migrate's advisory lock while it runs, so
// replicas starting together apply each migration once.
func Migrate(ctx context.Context, databaseURL string) error {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return fmt.Errorf("ledger: parse database URL: %w", err)
	}
	u.Scheme = "pgx5"
	q := u.Query()
	// pgxpool's settings and libpq's load_balance_hosts (Open's) are not
	// server parameters; migrations go to the URL's first host.
	for name := range q {
		if strings.HasPrefix(name, "pool_") || name == loadBalanceParam {
			q.Del(name)
		}
	}
	q.Set("x-migrations-table", MigrationsTable)
	u.RawQuery = q.Encode()

	src, err := iofs.New(migrations, "migrations")
	if err != nil {
		return fmt.Errorf("ledger: read embedded migrations: %w", err)
	}
	m, err := migrate.NewWithSourceInstance("iofs", src, u.String())
	if err != nil {
		return fmt.Errorf("ledger: open database for migration: %w", classify(err))
	}
	defer m.Close()
	done := make(chan error, 1)
	go func() { done <- m.Up() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		m.GracefulStop <- true
		err = <-done
	}
	if err != nil && !errors.Is(err, migrate.ErrNoChange) {
		return fmt.Errorf("ledger: migrate: %w", err)
	}
	return nil
}
