package pgtest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// StartStandby makes a streaming-replication standby of c (pg_basebackup
// -R: a hot standby following c over a replication connection) and starts
// it on its own port; it is stopped and deleted when t's cleanup runs. It
// has c's options. Whether c waits for it on commit is c's
// synchronous_standby_names ('*' names any standby).
func (c *Cluster) StartStandby(t testing.TB) *Cluster {
	t.Helper()
	s, err := c.startStandby()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pgtest: end of the standby's server log %s:\n%s", s.logPath, s.logTail())
		}
		if err := s.destroy(); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return s
}

func (c *Cluster) startStandby() (_ *Cluster, err error) {
	s := &Cluster{bin: c.bin, opts: c.opts, asUser: c.asUser}
	root, err := os.MkdirTemp(tempParent(c.opts), "pgtest-standby-")
	if err != nil {
		return nil, fmt.Errorf("create temporary directory: %w", err)
	}
	if s.root, err = filepath.EvalSymlinks(root); err != nil {
		_ = os.RemoveAll(root)
		return nil, fmt.Errorf("resolve temporary directory: %w", err)
	}
	defer func() {
		if err != nil {
			_ = s.destroy()
		}
	}()
	s.data = filepath.Join(s.root, "data")
	s.logPath = filepath.Join(s.root, "server.log")
	if s.asUser != nil {
		uid, _ := strconv.Atoi(s.asUser.Uid)
		gid, _ := strconv.Atoi(s.asUser.Gid)
		if err := os.Chown(s.root, uid, gid); err != nil {
			return nil, fmt.Errorf("hand %s to the postgres user: %w", s.root, err)
		}
	}
	if err := s.startWatchdog(); err != nil {
		return nil, err
	}
	args := []string{"-D", s.data, "-h", "127.0.0.1", "-p", strconv.Itoa(c.port), "-U", "postgres",
		"-R", "-X", "stream", "-c", "fast"}
	if !c.opts.Durable {
		args = append(args, "--no-sync")
	}
	if err := s.run("pg_basebackup", args...); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.port, err = freePort(); err != nil {
		return nil, err
	}
	if err := s.startLocked(); err != nil {
		return nil, err
	}
	return s, nil
}

// Promote ends recovery on a standby ("pg_ctl promote") and returns once it
// accepts writes as a primary.
func (c *Cluster) Promote() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return errors.New("pgtest: Promote on a stopped cluster")
	}
	if err := c.run("pg_ctl", "promote", "-w", "-t", "60", "-D", c.data); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}
