package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestMain lets the test binary serve the floor, as the bench binary does
// (startFloor starts os.Executable with floorServeArg).
func TestMain(m *testing.M) {
	if served, err := serveFloor(os.Args[1:]); served {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// TestFloorServer starts the floor's server as the floor's cells do and
// runs the cells' own pair and replay through it: the canned answers pass
// the checks the bench makes of the coordinator's (an acquired new key, a
// replay carrying the stored body).
func TestFloorServer(t *testing.T) {
	s := &settings{GRPCConns: 2, BodyBytes: 150, ReplayKeys: 8}
	e := &environment{s: s, payload: newPayload(s.BodyBytes)}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.floorAlive(); err == nil {
		t.Fatal("floorAlive before startFloor: nil")
	}
	if err := e.startFloor(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.stopFloor)
	r := rand.New(rand.NewPCG(1, 2))
	lat := make([]time.Duration, 2)
	for w := range 4 {
		if err := e.pair(ctx, e.floorStub(w), r, lat); err != nil {
			t.Fatalf("pair through connection %d: %v", w%s.GRPCConns, err)
		}
		if lat[0] <= 0 || lat[1] <= 0 {
			t.Errorf("pair latencies %v", lat)
		}
		if err := e.replay(ctx, e.floorStub(w), r, lat); err != nil {
			t.Fatalf("replay through connection %d: %v", w%s.GRPCConns, err)
		}
	}
	if err := e.serverAlive(kindFloorReplays); err != nil {
		t.Fatal(err)
	}
	cmd := e.floor.cmd
	e.stopFloor()
	if err := e.serverAlive(kindFloorPairs); err == nil {
		t.Error("serverAlive after stopFloor: nil")
	}
	if cmd.ProcessState == nil {
		t.Errorf("stopFloor returned before the floor's server (PID %d) exited", cmd.Process.Pid)
	}
}

// TestFloorNotes reads the stub's goals against the floor's rows: each
// stub goal notes what grpc-go alone did, and the report says what the
// floor is.
func TestFloorNotes(t *testing.T) {
	r := &report{Settings: &settings{Client: clientGo, Paths: []string{pathStub}, PathConcurrency: []int{64, 256}},
		Rows: []Row{{Concurrency: 64, LeanPerSec: 5000}},
		Paths: []PathRow{
			{Path: pathStub, Concurrency: 64, PairsPerSec: 4000, ReplaysPerSec: 18000, LeanRatio: 0.8, ReplayPairRatio: 4.5},
			{Path: pathStub, Concurrency: 256, PairsPerSec: 6000, ReplaysPerSec: 20000, LeanRatio: 1.5, ReplayPairRatio: 3.3},
			// The lean table did 5000 pairs/s at 64 callers.
			{Path: pathFloor, Concurrency: 64, PairsPerSec: 10000, ReplaysPerSec: 21000, LeanRatio: 2.0, ReplayPairRatio: 2.1},
			// The floor's replays run at 64 callers only.
			{Path: pathFloor, Concurrency: 256, PairsPerSec: 9000, LeanRatio: 2.25},
		}}
	notes := map[string]string{}
	for _, g := range r.goals() {
		notes[g.Name] = g.Note
	}
	for name, want := range map[string]string{
		"stub (unary) pairs/s vs lean at 64 callers":  "grpc-go alone (floor) 10000 pairs/s, 2.00x lean",
		"stub (unary) pairs/s vs lean at 256 callers": "grpc-go alone (floor) 9000 pairs/s, 2.25x lean",
		"stub replays/s vs pairs/s at 64 callers":     "grpc-go alone (floor) answers 21000 replays/s, 4.20x the lean table's pairs/s",
		"node replays/s vs pairs/s at 64 callers":     "",
	} {
		if !strings.Contains(notes[name], want) || (want == "" && notes[name] != "") {
			t.Errorf("note of %q = %q, want it to hold %q", name, notes[name], want)
		}
	}
	var out bytes.Buffer
	r.Machine.CPUs = 2
	r.Settings.Concurrency = []int{64}
	if err := r.print(&out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "floor: the stub's callers against grpc-go alone") {
		t.Errorf("the report does not say what the floor rows are:\n%s", out.String())
	}
	if !regexp.MustCompile(`floor\s+256\s+9000\s+2\.25\s+0\.00\s+-\s+-\s`).MatchString(out.String()) {
		t.Errorf("the floor's row at 256 callers, which has no replays, does not show them as -:\n%s", out.String())
	}
	// Without floor rows (an earlier report, or -paths without stub), no
	// note and no footnote.
	r.Paths = r.Paths[:2]
	for _, g := range r.goals() {
		if strings.Contains(g.Note, "floor") {
			t.Errorf("goal %q notes a floor that was not measured: %q", g.Name, g.Note)
		}
	}
}

// TestFloorCells checks which cells the floor runs and for how long: its
// pairs at every -paths-concurrency, its replays at 64 callers only (the
// one concurrency a goal reads them at), each for half the measured time
// of the other cells, and at least a second.
func TestFloorCells(t *testing.T) {
	for _, tc := range []struct {
		d, want time.Duration
	}{{6 * time.Second, 3 * time.Second}, {2 * time.Second, time.Second}, {time.Second, time.Second}} {
		e := &environment{s: &settings{Duration: tc.d}}
		if got := e.measuredFor(kindFloorPairs); got != tc.want {
			t.Errorf("-duration %v: floor cells measured for %v, want %v", tc.d, got, tc.want)
		}
		if got := e.measuredFor(kindStubPairs); got != tc.d {
			t.Errorf("-duration %v: stub cells measured for %v, want all of it", tc.d, got)
		}
	}
	// The rows the report derives from the floor's cells: one per
	// concurrency, with replays where they ran.
	r := &report{Settings: &settings{Client: clientGo, Paths: []string{pathStub}, PathConcurrency: []int{64, 256}},
		Cells: []Cell{
			{Kind: kindFloorPairs, Concurrency: 64, Seconds: 3, Ops: 30000},
			{Kind: kindFloorReplays, Concurrency: 64, Seconds: 3, Ops: 60000},
			{Kind: kindFloorPairs, Concurrency: 256, Seconds: 3, Ops: 27000},
		}}
	rows := r.pathRows(nil)
	if len(rows) != 2 {
		t.Fatalf("floor rows %+v, want 2", rows)
	}
	if rows[0].Concurrency != 64 || rows[0].PairsPerSec != 10000 || rows[0].ReplaysPerSec != 20000 || rows[0].ReplayPairRatio != 2 {
		t.Errorf("floor row at 64 callers: %+v", rows[0])
	}
	if rows[1].Concurrency != 256 || rows[1].PairsPerSec != 9000 || rows[1].ReplaysPerSec != 0 {
		t.Errorf("floor row at 256 callers: %+v", rows[1])
	}
}
