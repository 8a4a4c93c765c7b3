// Package procstat reads the CPU a process has used, from /proc and
// getrusage, for the benchmark driver (bench) and bench/grpcfloor. It
// imports the standard library only.
package procstat
