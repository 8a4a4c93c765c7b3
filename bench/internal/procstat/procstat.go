package procstat

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// ClockTicks is USER_HZ, the unit of the CPU times in /proc/<pid>/stat and /proc/stat:
// 100 on every Linux architecture Go supports.
const ClockTicks = 100

// Stat is the part of /proc/<pid>/stat the bench reads.
type Stat struct {
	PPID int
	CPU  float64 // utime + stime, seconds
}

// Read parses /proc/<pid>/stat.
func Read(pid int) (Stat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Stat{}, err
	}
	return Parse(b)
}

// Parse parses the content of /proc/<pid>/stat. The command name, in
// parentheses, may hold spaces: fields are counted from its closing one.
func Parse(b []byte) (Stat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Stat{}, fmt.Errorf("bad /proc stat %q", b)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
	if len(f) < 13 {
		return Stat{}, fmt.Errorf("short /proc stat %q", b)
	}
	ppid, err1 := strconv.Atoi(f[1])
	utime, err2 := strconv.ParseUint(f[11], 10, 64)
	stime, err3 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return Stat{}, fmt.Errorf("bad /proc stat %q", b)
	}
	return Stat{PPID: ppid, CPU: float64(utime+stime) / ClockTicks}, nil
}

// SelfCPU is this process's user and system CPU seconds so far.
func SelfCPU() (float64, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return seconds(ru.Utime) + seconds(ru.Stime), nil
}

func seconds(tv syscall.Timeval) float64 {
	return float64(tv.Sec) + float64(tv.Usec)/1e6
}
