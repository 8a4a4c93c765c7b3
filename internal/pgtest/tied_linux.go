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
//
// Linux sends the parent-death signal when the thread that forked the child
// exits, not only when the process does, so cmd is started and waited for
// on a goroutine locked to its thread: that thread lives exactly as long as
// the child (golang/go#27505). The signal survives SysProcAttr.Credential,
// which Go applies before it sets the signal, but not a program that
// changes its own user afterwards (runuser, pgbouncer -u): start such
// programs with Credential instead.
func startTied(cmd *exec.Cmd, sig syscall.Signal) (<-chan struct{}, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = sig
	started := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		// Never unlocked: when this goroutine returns, its thread ends,
		// after the child it forked.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return done, nil
}
