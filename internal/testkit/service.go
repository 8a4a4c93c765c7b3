package testkit

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// Service is a program run as its own process, which a test kills and
// starts again: the demo services of the examples under SIGKILL. The
// program prints a line "listening on ADDR" on its standard output once it
// serves; its standard error goes to Log.
type Service struct {
	// Bin is the program, Args its arguments, Env added to the test's
	// environment.
	Bin  string
	Args []string
	Env  []string
	// Log receives the program's standard error, over every start.
	Log *os.File

	cmd *exec.Cmd
}

// Start starts the program and waits until it prints that it listens.
func (s *Service) Start() error {
	cmd := exec.Command(s.Bin, s.Args...) //nolint:gosec // the test names the program it built
	cmd.Env = append(os.Environ(), s.Env...)
	cmd.Stderr = s.Log
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "listening on") {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("%s did not start: %q %v\n%s", s.Bin, line, err, s.LogTail(4000))
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	s.cmd = cmd
	return nil
}

// Stop sends sig to the program, if it runs, and waits for it to exit.
func (s *Service) Stop(sig syscall.Signal) {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(sig)
	_ = s.cmd.Wait()
	s.cmd = nil
}

// LogTail is the last n bytes of the program's standard error.
func (s *Service) LogTail(n int) string {
	if s.Log == nil {
		return ""
	}
	b, _ := os.ReadFile(s.Log.Name())
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// Killer is the goroutine of KillRepeatedly.
type Killer struct {
	done   chan struct{}
	killed int
	err    error
}

// KillRepeatedly SIGKILLs the program kills times and starts it again at
// once, each time after a random pause of minPause plus up to spread,
// until stop closes. A start that fails ends it; see Result.
func (s *Service) KillRepeatedly(kills int, minPause, spread time.Duration, stop <-chan struct{}) *Killer {
	k := &Killer{done: make(chan struct{})}
	go func() {
		defer close(k.done)
		for k.killed < kills {
			select {
			case <-stop:
				return
			case <-time.After(minPause + rand.N(spread)): //nolint:gosec // a test's random pause, not a secret
			}
			s.Stop(syscall.SIGKILL)
			k.killed++
			if k.err = s.Start(); k.err != nil {
				return
			}
		}
	}()
	return k
}

// Done is closed once the killer is through.
func (k *Killer) Done() <-chan struct{} { return k.done }

// Through reports whether the killer is through.
func (k *Killer) Through() bool {
	select {
	case <-k.done:
		return true
	default:
		return false
	}
}

// Result waits until the killer is through and returns how many times it
// killed the program, and the error of a start that failed.
func (k *Killer) Result() (killed int, err error) {
	<-k.done
	return k.killed, k.err
}
