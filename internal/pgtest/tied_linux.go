package pgtest

import (
	"os/exec"
	"runtime"
	"syscall"
)

// startTied starts cmd so that it ends with this process, however this
// process ends (a SIGKILL included): the kernel sends it sig when its
// parent dies (PR_SET_PDEATHSIG). The returned channel is closed once cmd
// has exited and been waited for (cmd.ProcessState is then set).
func startTied(cmd *exec.Cmd, sig syscall.Signal) (<-chan struct{}, error) {
	done := make(chan struct{})
	err := tie(cmd, sig, func() {
		_ = cmd.Wait()
		close(done)
	})
	if err != nil {
		return nil, err
	}
	return done, nil
}

// StartTied starts cmd so that the kernel sends it sig if this process
// dies, however it dies (a SIGKILL included), until release is closed; the
// caller waits for cmd as usual. Closing release also sends cmd sig if it
// is still running: close it when the test is over (coordtest.StartTied
// does, at the test's cleanup).
func StartTied(cmd *exec.Cmd, sig syscall.Signal, release <-chan struct{}) error {
	return tie(cmd, sig, func() { <-release })
}

// tie starts cmd with sig as its parent-death signal, then runs hold on
// the thread that started it.
//
// Linux sends the parent-death signal when the thread that forked the child
// exits, not only when the process does, so cmd is started on a goroutine
// locked to its thread, and the thread lives until hold returns
// (golang/go#27505). The signal survives SysProcAttr.Credential, which Go
// applies before it sets the signal, but not a program that changes its own
// user afterwards (runuser, pgbouncer -u): start such programs with
// Credential instead.
func tie(cmd *exec.Cmd, sig syscall.Signal, hold func()) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = sig
	started := make(chan error, 1)
	go func() {
		// Never unlocked: when this goroutine returns, its thread ends,
		// and with it the parent-death signal fires.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		hold()
	}()
	return <-started
}
