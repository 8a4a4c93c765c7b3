package pgtest

import "fmt"

// Launch starts a cluster for a program that is not a test, such as the
// benchmark driver in bench/: a durable one (opts.Durable) keeps fsync,
// synchronous_commit and full_page_writes on and its files on disk. The
// caller owns it and must Close it; if the process dies first, the
// watchdog stops the server and deletes its files, as for a test's cluster.
func Launch(opts ClusterOptions) (*Cluster, error) {
	c, err := startCluster(opts)
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	return c, nil
}

// Close stops the cluster and deletes its files. Closing twice is harmless.
func (c *Cluster) Close() error {
	if err := c.destroy(); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// PostmasterPID returns the process ID of the running postmaster, or 0
// while the cluster is stopped. Every other server process is its child.
func (c *Cluster) PostmasterPID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return 0
	}
	return c.proc.pid
}

// LogTail returns the end of the server log, for error reports.
func (c *Cluster) LogTail() string { return c.logTail() }

// LaunchCitus starts a Citus cluster (a coordinator node and two workers,
// opts applying to each) for a program that is not a test, as Launch
// does a single cluster. The caller owns it and must Close it.
func LaunchCitus(opts ClusterOptions) (*CitusCluster, error) {
	cc, err := startCitusCluster(opts)
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	return cc, nil
}

// Close stops every node of the cluster and deletes its files.
func (cc *CitusCluster) Close() error {
	if err := cc.destroy(); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// CitusMissing says why the Citus extension cannot be used with the
// PostgreSQL that pgtest starts, or returns nil when it is installed.
func CitusMissing() error { return citusInstalled() }
