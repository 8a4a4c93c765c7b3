//go:build !linux

package pgtest

import (
	"os/exec"
	"syscall"
)

// startTied starts cmd; the returned channel is closed once it has exited
// and been waited for. Without Linux's parent-death signal, only the
// watchdog (for clusters) ends it when this process dies.
func startTied(cmd *exec.Cmd, _ syscall.Signal) (<-chan struct{}, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	return done, nil
}

// StartTied starts cmd; without Linux's parent-death signal it does not end
// with this process. release is ignored.
func StartTied(cmd *exec.Cmd, _ syscall.Signal, _ <-chan struct{}) error {
	return cmd.Start()
}
