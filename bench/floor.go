package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/bench/internal/floor"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// pathFloor names the rows of the unary path's floor: the generated stub's
// callers against grpc-go alone (bench/internal/floor: canned answers of
// the coordinator's size, no coordinator, no database), measured whenever
// the stub path is, at the same callers. It is what grpc-go itself allows
// on the machine, so it bounds what any server written with it reaches
// for unary callers there: the stub's goals are read against it.
const pathFloor = "floor"

// floorServeArg, as the bench's first argument, makes it the floor's
// server: bench serve-floor ADDR BODY_BYTES.
const floorServeArg = "serve-floor"

// serveFloor serves the floor when args ask for it (floorServeArg).
func serveFloor(args []string) (served bool, err error) {
	if len(args) != 3 || args[0] != floorServeArg {
		return false, nil
	}
	bodyBytes, err := strconv.Atoi(args[2])
	if err != nil {
		return true, fmt.Errorf("%s: body bytes %q: %w", floorServeArg, args[2], err)
	}
	return true, floor.Serve(args[1], bodyBytes)
}

// floorServer is the floor's server process and the stubs of its callers.
type floorServer struct {
	cmd   *exec.Cmd
	done  chan struct{} // closed when the process has exited
	tie   chan struct{} // closed after it exited, to end the thread that started it
	conns []*grpc.ClientConn
	stubs []coordinatorCalls // one per connection, as the stub path's
}

// startFloor starts this binary as the floor's server (a separate process,
// as the coordinator is) and connects -grpc-conns connections to it.
func (e *environment) startFloor(ctx context.Context) (err error) {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	addr, err := freeAddr()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, floorServeArg, addr, strconv.Itoa(e.s.BodyBytes))
	cmd.Stderr = os.Stderr
	tie := make(chan struct{})
	if err := pgtest.StartTied(cmd, syscall.SIGKILL, tie); err != nil {
		return fmt.Errorf("start the floor's server: %w", err)
	}
	f := &floorServer{cmd: cmd, done: make(chan struct{}), tie: tie}
	go func() {
		_ = cmd.Wait()
		close(f.done)
	}()
	e.floor = f
	defer func() {
		if err != nil {
			e.stopFloor()
		}
	}()
	for range e.s.GRPCConns {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		f.conns = append(f.conns, conn)
		f.stubs = append(f.stubs, newStub(conn))
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := f.stubs[0].Begin(cctx, &idempotencyv1.BeginRequest{Scope: benchScope, Key: "ready"})
		cancel()
		if err == nil {
			break
		}
		if alive := e.floorAlive(); alive != nil || ctx.Err() != nil || time.Now().After(deadline) {
			return errors.Join(fmt.Errorf("the floor's server is not answering: %w", err), alive, ctx.Err())
		}
		sleep(ctx, 50*time.Millisecond)
	}
	logf("floor's server (grpc-go, canned answers) PID %d on %s", cmd.Process.Pid, addr)
	return nil
}

// floorAlive returns an error once the floor's server has exited.
func (e *environment) floorAlive() error {
	if e.floor == nil {
		return errors.New("the floor's server is not running")
	}
	select {
	case <-e.floor.done:
		return fmt.Errorf("the floor's server exited: %v", e.floor.cmd.ProcessState)
	default:
		return nil
	}
}

// stopFloor closes the floor's connections and kills its server.
func (e *environment) stopFloor() {
	f := e.floor
	if f == nil {
		return
	}
	for _, c := range f.conns {
		_ = c.Close()
	}
	_ = f.cmd.Process.Kill()
	<-f.done
	close(f.tie)
	e.floor = nil
}

// floorStub returns the generated stub of caller w against the floor.
func (e *environment) floorStub(w int) coordinatorCalls {
	return e.floor.stubs[w%len(e.floor.stubs)]
}

// floorReplayCallers is the one concurrency of the floor's replays cell:
// the one the stub's replay goal reads.
const floorReplayCallers = 64

// measuredFor is the measured time of kind's cells: the floor's, whose
// server answers at a steady rate, run half as long as the others (at
// least a second), to keep make bench within its run time.
func (e *environment) measuredFor(kind cellKind) time.Duration {
	if kind.floor() {
		return max(e.s.Duration/2, time.Second)
	}
	return e.s.Duration
}

// runFloor measures the floor's pairs at every concurrency of
// -paths-concurrency, and its replays at floorReplayCallers, with the stub
// path's callers.
func (e *environment) runFloor(ctx context.Context) ([]Cell, error) {
	if err := e.startFloor(ctx); err != nil {
		return nil, err
	}
	defer e.stopFloor()
	var cells []Cell
	for _, c := range e.s.PathConcurrency {
		for _, replays := range []bool{false, true} {
			if replays && c != floorReplayCallers {
				continue
			}
			cell, err := e.runCell(ctx, pathKind(pathFloor, replays), c, nil)
			if err != nil {
				return nil, err
			}
			cells = append(cells, cell)
		}
	}
	return cells, nil
}
