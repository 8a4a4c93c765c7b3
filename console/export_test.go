package console

import "time"

// SampleAt records a sample of the counters as Run does at its ticks, so
// tests fill the chart without waiting.
func SampleAt(c *Console, at time.Time) { c.ring.add(at, c.opts.counters()) }

// SafeNext is safeNext, for the table of sign-in redirects.
func SafeNext(next string) string { return safeNext(next) }
