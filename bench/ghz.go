package main

import (
	"context"
	"debug/buildinfo"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"
)

// GhzRow is a cell measured by ghz, a load generator that is not ours,
// next to our own figure for the same work.
type GhzRow struct {
	Version     string  `json:"ghz_version"`
	Call        string  `json:"call"`
	Concurrency int     `json:"concurrency"`
	Seconds     float64 `json:"seconds"`
	Count       uint64  `json:"count"`
	OK          int     `json:"ok"`
	// PerSec is the successful calls over ghz's total time. Calls still in
	// flight when the duration ends fail (the connection closes under them)
	// and are left out.
	PerSec float64 `json:"per_s"`
	P50MS  float64 `json:"p50_ms"`
	P99MS  float64 `json:"p99_ms"`
	// Errors maps each error ghz saw to its count.
	Errors map[string]int `json:"errors,omitempty"`
	// GeneratorCPUPer1000 is ghz's own CPU seconds per 1000 calls: it
	// shares the machine with the coordinator and PostgreSQL.
	GeneratorCPUPer1000 float64 `json:"generator_cpu_s_per_1000"`
	// OursPerSec, OursP50MS and OursP99MS are our replay cell at the same
	// concurrency (0 when the run did not measure it), and
	// OursGeneratorCPUPer1000 this driver's CPU seconds per 1000 replays.
	OursPerSec              float64 `json:"ours_per_s"`
	OursP50MS               float64 `json:"ours_p50_ms"`
	OursP99MS               float64 `json:"ours_p99_ms"`
	OursGeneratorCPUPer1000 float64 `json:"ours_generator_cpu_s_per_1000"`
}

// ghzReport is the part of ghz's JSON output (--format json) we read.
type ghzReport struct {
	Count               uint64         `json:"count"`
	Total               time.Duration  `json:"total"`
	Rps                 float64        `json:"rps"`
	ErrorDist           map[string]int `json:"errorDistribution"`
	StatusCodeDist      map[string]int `json:"statusCodeDistribution"`
	LatencyDistribution []struct {
		Percentage int           `json:"percentage"`
		Latency    time.Duration `json:"latency"`
	} `json:"latencyDistribution"`
}

// runGhz replays the replay cells' keys with ghz, over server reflection
// (ghz needs no proto files), for the measured duration, at the ghz
// concurrency. Each request picks a key by its request number.
func (e *environment) runGhz(ctx context.Context) (*GhzRow, error) {
	if err := e.coordinatorAlive(); err != nil {
		return nil, err
	}
	if err := e.exec(ctx, "CHECKPOINT"); err != nil {
		return nil, err
	}
	data, err := json.Marshal(map[string]string{
		"scope":       benchScope,
		"key":         "replay-{{mod .RequestNumber " + strconv.Itoa(e.s.ReplayKeys) + "}}",
		"fingerprint": base64.StdEncoding.EncodeToString(e.payload.fingerprint),
	})
	if err != nil {
		return nil, err
	}
	out := filepath.Join(e.dir, "ghz.json")
	dur := e.s.Warmup + e.s.Duration
	args := []string{"--insecure", "--call", "idempotency.v1.Coordinator.Begin", "--data", string(data),
		"--concurrency", strconv.Itoa(e.s.GhzConcurrency), "--connections", strconv.Itoa(e.s.GRPCConns),
		"--duration", dur.String(), "--format", "json", "--output", out, e.addr}
	logf("ghz %v", args)
	cctx, cancel := context.WithTimeout(ctx, dur+2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, e.s.ghz, args...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("ghz: %w: %s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, err
	}
	row, err := parseGhz(b)
	if err != nil {
		return nil, err
	}
	row.Call, row.Concurrency = "Begin (replay)", e.s.GhzConcurrency
	if bi, err := buildinfo.ReadFile(e.s.ghz); err == nil {
		row.Version = bi.Main.Version
	}
	if ps := cmd.ProcessState; ps != nil && row.OK > 0 {
		row.GeneratorCPUPer1000 = (ps.UserTime() + ps.SystemTime()).Seconds() / float64(row.OK) * 1000
	}
	logf("ghz      %4d callers: %9.0f/s  begin p50 %.2f p99 %.2f ms  %d OK, %d failed",
		row.Concurrency, row.PerSec, row.P50MS, row.P99MS, row.OK, row.Count-uint64(row.OK))
	return row, nil
}

// parseGhz reads ghz's JSON report.
func parseGhz(b []byte) (*GhzRow, error) {
	var r ghzReport
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("ghz report: %w", err)
	}
	row := &GhzRow{Seconds: r.Total.Seconds(), Count: r.Count, OK: r.StatusCodeDist["OK"], Errors: r.ErrorDist}
	if r.Total > 0 {
		row.PerSec = float64(row.OK) / r.Total.Seconds()
	}
	for _, l := range r.LatencyDistribution {
		ms := float64(l.Latency.Microseconds()) / 1000
		switch l.Percentage {
		case 50:
			row.P50MS = ms
		case 99:
			row.P99MS = ms
		}
	}
	if row.OK == 0 {
		return row, fmt.Errorf("ghz: no call succeeded: %v", r.ErrorDist)
	}
	return row, nil
}
