package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/idemcoord/idemcoord/bench/internal/procstat"
)

// snapshot is the CPU used so far by the coordinator, PostgreSQL and this
// process, and the coordinator's peak RSS.
type snapshot struct {
	at       time.Time
	coordCPU float64 // seconds
	pgCPU    float64 // seconds, the postmaster and its children alive now
	selfCPU  float64 // seconds
	coordHWM float64 // MB
	busyCPU  float64 // seconds, the whole machine (every CPU, every process)
	stealCPU float64 // seconds the hypervisor gave to other machines
	// workerCPU is, on Citus, each worker's postmaster and children.
	workerCPU []float64
}

// snapshot reads the counters; coordPID 0 skips the coordinator's.
func (e *environment) snapshot(coordPID int) snapshot {
	s := snapshot{at: time.Now()}
	if coordPID != 0 {
		if st, err := procstat.Read(coordPID); err == nil {
			s.coordCPU = st.CPU
		}
		s.coordHWM, _ = peakRSS(coordPID)
	}
	if pm := e.cluster.PostmasterPID(); pm != 0 {
		s.pgCPU = treeCPU(pm)
	}
	for _, w := range e.workers {
		s.workerCPU = append(s.workerCPU, treeCPU(w.PostmasterPID()))
	}
	s.busyCPU, s.stealCPU, _ = machineCPU()
	s.selfCPU, _ = procstat.SelfCPU()
	return s
}

// treeCPU returns the CPU seconds of root and of its children alive now;
// PostgreSQL backends and background workers are all children of the
// postmaster. A backend that exits between two snapshots takes its share
// with it, so the difference can only undercount.
func treeCPU(root int) float64 {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var total float64
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		st, err := procstat.Read(pid)
		if err == nil && (pid == root || st.PPID == root) {
			total += st.CPU
		}
	}
	return total
}

// machineCPU returns the CPU seconds the machine's processes used since
// boot (user, nice and system time) and those the hypervisor stole, from
// the first line of /proc/stat.
func machineCPU() (busy, steal float64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	return parseMachineCPU(b)
}

func parseMachineCPU(b []byte) (busy, steal float64, err error) {
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	// cpu user nice system idle iowait irq softirq steal …
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("bad /proc/stat line %q", line)
	}
	var v [8]float64
	for i := range v {
		n, err := strconv.ParseUint(f[i+1], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("bad /proc/stat line %q", line)
		}
		v[i] = float64(n) / procstat.ClockTicks
	}
	// Interrupt time is left out: with IRQ time accounting, the softirq
	// work of loopback traffic is in no process's stime.
	return v[0] + v[1] + v[2], v[7], nil
}

// peakRSS returns VmHWM of pid in MB.
func peakRSS(pid int) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return parseHWM(f)
}

func parseHWM(f io.Reader) (float64, error) {
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err != nil {
				return 0, fmt.Errorf("bad VmHWM line %q", sc.Text())
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmHWM in status: %v", sc.Err())
}

// resetPeakRSS sets VmHWM back to the current RSS (Linux 4.0 and later),
// so the next reading is the peak of what follows.
func resetPeakRSS(pid int) error {
	return os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
}

// machine describes where the figures come from.
type machine struct {
	CPUs      int    `json:"cpus"`
	CPUModel  string `json:"cpu_model,omitempty"`
	MemoryMB  int    `json:"memory_mb,omitempty"`
	Kernel    string `json:"kernel,omitempty"`
	GoVersion string `json:"go"`
}

func describeMachine() machine {
	m := machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int
		if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err == nil {
			m.MemoryMB = kb / 1024
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	return m
}

// workersCPU returns each worker's CPU seconds between before and s, or
// nil when there are no workers.
func (s snapshot) workersCPU(before snapshot) []float64 {
	var out []float64
	for i, c := range s.workerCPU {
		if i < len(before.workerCPU) {
			out = append(out, c-before.workerCPU[i])
		}
	}
	return out
}
