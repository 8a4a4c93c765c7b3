package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// loadBalanceParam is libpq's (16+) connection parameter that spreads
// connections over a multi-host URL's hosts. pgx does not know it: it
// tries the hosts in order and would send the parameter to the server as
// a run-time setting, which the server refuses.
const loadBalanceParam = "load_balance_hosts"

// balanceHosts reads load_balance_hosts from cfg's parsed URL, as libpq
// does: "disable" (the default) tries the hosts in the URL's order;
// "random" makes each new connection of the pool try the hosts in a
// random order (one host picked at random first, then the others in the
// URL's order, so a host that is down still falls back to the next). It
// removes the parameter from the run-time parameters sent to the server.
// Any other value is an error. It reports whether it spreads.
func balanceHosts(cfg *pgxpool.Config) (bool, error) {
	v, ok := cfg.ConnConfig.RuntimeParams[loadBalanceParam]
	if !ok {
		return false, nil
	}
	delete(cfg.ConnConfig.RuntimeParams, loadBalanceParam)
	switch v {
	case "disable":
		return false, nil
	case "random":
	default:
		return false, fmt.Errorf("invalid %s value: %q (want disable or random)", loadBalanceParam, v)
	}
	next := cfg.BeforeConnect
	cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		if next != nil {
			if err := next(ctx, cc); err != nil {
				return err
			}
		}
		randomFirstHost(&cc.Config)
		return nil
	}
	return true, nil
}

// firstHostPool returns a small pool of balanced's configuration whose
// connections go to the URL's first host (falling back to the others in
// order), as without load_balance_hosts.
func firstHostPool(ctx context.Context, balanced *pgxpool.Config) (*pgxpool.Pool, error) {
	cfg := balanced.Copy()
	cfg.BeforeConnect = nil
	cfg.MaxConns = 4
	return pgxpool.NewWithConfig(ctx, cfg)
}

// randomFirstHost reorders c's hosts (Host, Port and the Fallbacks) so
// that the entries of one host, picked at random among its distinct
// hosts, come first; the rest keep their order. pgconn tries the entries
// in order. c must be a copy: pgxpool passes BeforeConnect one.
func randomFirstHost(c *pgconn.Config) {
	all := append([]*pgconn.FallbackConfig{{Host: c.Host, Port: c.Port, TLSConfig: c.TLSConfig}}, c.Fallbacks...)
	type hostPort struct {
		host string
		port uint16
	}
	var hosts []hostPort
	for _, f := range all {
		hp := hostPort{f.Host, f.Port}
		if len(hosts) == 0 || hosts[len(hosts)-1] != hp {
			hosts = append(hosts, hp)
		}
	}
	if len(hosts) < 2 {
		return
	}
	pick := hosts[rand.IntN(len(hosts))] //nolint:gosec // which host a connection tries first, not a secret
	ordered := make([]*pgconn.FallbackConfig, 0, len(all))
	var rest []*pgconn.FallbackConfig
	for _, f := range all {
		if (hostPort{f.Host, f.Port}) == pick {
			ordered = append(ordered, f)
		} else {
			rest = append(rest, f)
		}
	}
	ordered = append(ordered, rest...)
	c.Host, c.Port, c.TLSConfig = ordered[0].Host, ordered[0].Port, ordered[0].TLSConfig
	c.Fallbacks = ordered[1:]
}
