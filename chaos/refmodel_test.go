package chaos

import (
	"fmt"
	"hash/maphash"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// This file is a reference model of one key, written from the state table
// of docs/concepts.md (its states and transitions, sticky uncertainty, the
// rules on tokens and time, and the generation's checkpoint) without the
// statemachine package, so that a
// specification bug in statemachine.Next cannot hide by being its own
// judge. TestLinearizableReference checks the coordinator's histories
// against it.
//
// Where the state table leaves a choice open, the model accepts each reading and
// says so at the spot (look for "open:"): a fault the model cannot tell from
// a correct answer is not a fault it claims to catch.

// The states as the API numbers them (idempotency.v1.State).
const (
	rsNone             = 0
	rsInProgress       = 1
	rsCompleted        = 2
	rsFailedRetryable  = 3
	rsFailedReplayable = 4
	rsExpired          = 5
	rsUnknown          = 6
)

var rsNames = [...]string{"NONE", "IN_PROGRESS", "COMPLETED", "FAILED_RETRYABLE", "FAILED_REPLAYABLE", "EXPIRED", "UNKNOWN"}

// The outcomes of Begin (idempotency.v1.Outcome).
const (
	roAcquired   = 1
	roReplay     = 2
	roInProgress = 3
)

// The failure kinds (idempotency.v1.FailureKind).
const (
	rfRetryable  = 1
	rfReplayable = 2
	rfUnknown    = 3
	rfAbandoned  = 4
)

var rfNames = [...]string{"", "RETRYABLE", "REPLAYABLE", "UNKNOWN", "ABANDONED"}

// The resolutions of Admin.Resolve (idempotency.v1.Resolution).
const (
	rrCompleted = 1
	rrRetryable = 2
)

// refKind names a call of the reference history.
type refKind uint8

const (
	rkBegin refKind = iota
	rkComplete
	rkFail
	rkHeartbeat
	rkLookup
	rkResolve
	rkForget
	rkReap
)

var rkNames = [...]string{"Begin", "Complete", "Fail", "Heartbeat", "Lookup", "Resolve", "Forget", "Reap"}

// How an acquisition began, for Fail ABANDONED ("as before this
// acquisition").
const (
	originCreated   = 1 // the Begin inserted the record
	originRestart   = 2 // a new generation after expiry
	originTakeover  = 3 // from FAILED_RETRYABLE of a certain generation
	originUncertain = 4 // from UNKNOWN, or from an uncertain FAILED_RETRYABLE
)

// How the latest acquisition ended.
const (
	endNone     = 0
	endComplete = 10
	// endFail+kind for a Fail of that kind.
	endFail     = 20
	endResolved = 30
)

// refPolicy is the part of a scope's policy the table depends on.
type refPolicy struct {
	reject      bool // on_expired: reject
	hold        bool // on_unknown: hold
	maxAttempts int32
	failureTTL  time.Duration
}

// refCall is one call as the model sees it.
type refCall struct {
	id     int
	client int
	kind   refKind
	scope  string
	key    string
	// nows are the clock readings the call may have acted at: the clock
	// moves during a round, and the call saw one of these.
	nows []time.Time
	pol  refPolicy

	// Begin.
	fp        string
	attemptID string
	ttl       time.Duration
	lease     time.Duration // Begin, Heartbeat
	wait      time.Duration
	accept    []string
	// Complete, Fail, Heartbeat.
	token    string
	failKind int
	resp     string // canonical response ("" = none sent)
	hasResp  bool
	msg      *idempotencyv1.StoredResponse // the response as sent
	reason   string
	// Heartbeat with a checkpoint (hasCk); ckBad when it breaks the limits
	// (phase 1-128 printable bytes, data at most 64 KiB).
	hasCk           bool
	ckPhase, ckData string
	ckBad           bool
	// Resolve.
	resolveAs int
	// Reap.
	retention time.Duration
	// start and end are the call's real times (ns since the history
	// began); end is the end of its round when it went unanswered.
	start, end int64
}

// refAnswer is what the call answered.
type refAnswer struct {
	unknown bool   // no answer: it may or may not have taken effect
	err     string // "" for OK; NOT_FOUND or the ErrorInfo reason
	outcome int
	token   string
	prev    int
	rec     *refView
}

// refView is what a caller sees of a record.
type refView struct {
	state        int
	fp           string
	attempt, gen int32
	resp         string
	hasResp      bool
	reason       string
	lease        int64 // UnixMicro, 0 when unset
	expires      int64
	hasUncertain bool // the API has Record.uncertain
	uncertain    bool
	ck           refCheckpoint
}

// refCheckpoint is a record's checkpoint as a caller sees it; the zero
// value is none.
type refCheckpoint struct {
	set         bool
	phase, data string
	at          int64 // UnixMicro
}

func (c refCheckpoint) String() string {
	if !c.set {
		return "-"
	}
	data := c.data
	if len(data) > 24 {
		data = fmt.Sprintf("%s…(%d bytes)", data[:16], len(data))
	}
	return fmt.Sprintf("%q:%q@%s", c.phase, data, microString(c.at))
}

func (v refView) String() string {
	s := fmt.Sprintf("%s a%d g%d fp=%q lease=%s expires=%s", rsNames[v.state], v.attempt, v.gen, v.fp, microString(v.lease), microString(v.expires))
	if v.hasResp {
		s += " resp=" + v.resp
	}
	if v.reason != "" {
		s += fmt.Sprintf(" reason=%q", v.reason)
	}
	if v.hasUncertain {
		s += fmt.Sprintf(" uncertain=%v", v.uncertain)
	}
	if v.ck.set {
		s += " ckpt=" + v.ck.String()
	}
	return s
}

func microString(us int64) string {
	if us == 0 {
		return "-"
	}
	return time.UnixMicro(us).UTC().Format("15:04:05.000")
}

// placeholder is the token of an acquisition by the call numbered id
// while nobody knows it: the call went unanswered, and a Begin with the
// same attempt_id reveals it.
func placeholder(id int) string { return fmt.Sprintf("?%d", id) }

func isPlaceholder(tok string) bool { return len(tok) > 0 && tok[0] == '?' }

// refKey is the model's state of one key. Every field is comparable, so
// states compare with ==.
type refKey struct {
	exists       bool
	state        int // as stored (reads see refEffective of it)
	fp           string
	attempt, gen int32
	token        string // latest acquisition's token; "?N" while unknown
	attemptID    string
	prev         int // previous_state this acquisition answered
	origin       int
	ended        int
	endResp      string // content of the ending call, for its repeat
	endHasResp   bool
	endReason    string
	resp         string // stored response
	hasResp      bool
	reason       string
	lease        int64
	expires      int64
	ttl, fttl    time.Duration // of this acquisition
	uncertain    bool
	expiredFrom  int
	// ck is the generation's last checkpoint; ckMine says the latest
	// acquisition recorded it (its Fail ABANDONED is refused).
	ck     refCheckpoint
	ckMine bool
	// A record Forget deleted may still be replayed from the replay
	// cache until ghostUntil (real time): up to 1 s is allowed (docs/design.md).
	ghostUntil                int64
	ghostState                int
	ghostFp, ghostResp        string
	ghostAttempt, ghostGen    int32
	ghostExpires, ghostUCount int64
	ghostCk                   refCheckpoint
}

func (k refKey) String() string {
	if !k.exists {
		return "(none)"
	}
	return fmt.Sprintf("%s a%d g%d fp=%q tok=%s aid=%s prev=%s origin=%d ended=%d lease=%s expires=%s resp=%v:%s reason=%q uncertain=%v ckpt=%s mine=%v",
		rsNames[k.state], k.attempt, k.gen, k.fp, k.token, k.attemptID, rsNames[k.prev], k.origin, k.ended,
		microString(k.lease), microString(k.expires), k.hasResp, k.resp, k.reason, k.uncertain, k.ck, k.ckMine)
}

// refEffective is k as in effect at now: a lapsed lease reads UNKNOWN (and
// makes the generation uncertain), an ended record past expires_at reads
// EXPIRED without its response and its checkpoint.
func refEffective(k refKey, now int64) (e refKey, lapsed, expired bool) {
	e = k
	switch {
	case k.state == rsInProgress && now >= k.lease:
		e.state, e.uncertain, lapsed = rsUnknown, true, true
	case (k.state == rsCompleted || k.state == rsFailedRetryable || k.state == rsFailedReplayable) && k.expires != 0 && now >= k.expires:
		e.expiredFrom, e.state, e.resp, e.hasResp, expired = k.state, rsExpired, "", false, true
		e.ck, e.ckMine = refCheckpoint{}, false
	}
	return e, lapsed, expired
}

// view is what a caller is told of k.
func (k refKey) view() refView {
	v := refView{state: k.state, fp: k.fp, attempt: k.attempt, gen: k.gen, resp: k.resp, hasResp: k.hasResp,
		reason: k.reason, lease: k.lease, expires: k.expires, uncertain: k.uncertain, ck: k.ck}
	return v
}

// viewMatches reports whether the answered record got agrees with the
// model's want on everything the state table fixes.
func viewMatches(want, got refView) bool {
	if want.state != got.state || want.attempt != got.attempt || want.gen != got.gen || want.fp != got.fp {
		return false
	}
	switch want.state {
	case rsInProgress:
		if got.lease != want.lease || got.expires != 0 || got.hasResp {
			return false
		}
	case rsUnknown:
		// open: lease_expires_at of an UNKNOWN record (kept when read
		// lazily, cleared when written down) is not fixed.
		if got.expires != 0 {
			return false
		}
	case rsCompleted, rsFailedReplayable:
		if got.expires != want.expires || !got.hasResp || got.resp != want.resp {
			return false
		}
	case rsFailedRetryable:
		if got.expires != want.expires {
			return false
		}
	case rsExpired:
		if got.expires != want.expires || got.hasResp {
			return false
		}
	}
	// failure_reason is fixed right after a Fail (the model clears
	// reason otherwise and then does not compare it).
	if want.reason != "" && want.state != rsExpired && got.reason != want.reason {
		return false
	}
	if got.hasUncertain && want.state != rsExpired && got.uncertain != want.uncertain {
		return false
	}
	// Record.checkpoint is the generation's last checkpoint (phase, data
	// and the coordinator's time of it) in every state; an EXPIRED record
	// has none.
	return got.ck == want.ck
}

// answerView is the record c's answer a must carry when the key is k:
// k's view, without its checkpoint where the answer may leave it out and
// a's does.
//
// open: docs/recovery-points.md has a Begin that does not acquire (a
// replay, an IN_PROGRESS answer) leave the checkpoint out, Lookup having
// it, yet an UNKNOWN record held under on_unknown: hold answers with it;
// it says nothing of Complete's and Forget's answers, which leave it out.
// Those answers may carry the generation's checkpoint or none, never
// another. Every other answered record carries it: a Begin that acquires,
// Lookup, Heartbeat, Fail and Resolve.
func answerView(k refKey, c refCall, a refAnswer) refView {
	v := k.view()
	omits := (c.kind == rkBegin && a.outcome != roAcquired) || c.kind == rkComplete || c.kind == rkForget
	if omits && a.rec != nil && !a.rec.ck.set {
		v.ck = refCheckpoint{}
	}
	return v
}

// refNext is one state the key may be in after a call, with the table rows
// the call exercised on the way.
type refNext struct {
	k      refKey
	labels []string
}

// refStep returns the states the key may be in after c answered a, none
// when the answer contradicts the model.
func refStep(k refKey, c refCall, a refAnswer) []refNext {
	var out []refNext
	for _, now := range c.nows {
		out = append(out, refStepAt(k, c, a, now.UnixMicro())...)
	}
	return out
}

func refStepAt(k refKey, c refCall, a refAnswer, now int64) []refNext {
	if k.ghostUntil != 0 && c.start >= k.ghostUntil {
		k.ghostUntil, k.ghostState, k.ghostFp, k.ghostResp, k.ghostAttempt, k.ghostGen, k.ghostExpires = 0, 0, "", "", 0, 0, 0
		k.ghostCk = refCheckpoint{}
	}
	return keepGhost(k, refStepIn(k, c, a, now))
}

// keepGhost carries k's forgotten record into every next state that has
// none of its own: the replay cache bounds a replay from the cache of a forgotten
// record by the time since Forget returned (1 s), whatever the key has
// become since (a new record, created and changed, included).
func keepGhost(k refKey, nexts []refNext) []refNext {
	if k.ghostUntil == 0 {
		return nexts
	}
	for i := range nexts {
		if n := &nexts[i].k; n.ghostUntil == 0 {
			n.ghostUntil, n.ghostState, n.ghostFp, n.ghostResp = k.ghostUntil, k.ghostState, k.ghostFp, k.ghostResp
			n.ghostAttempt, n.ghostGen, n.ghostExpires, n.ghostUCount = k.ghostAttempt, k.ghostGen, k.ghostExpires, k.ghostUCount
			n.ghostCk = k.ghostCk
		}
	}
	return nexts
}

// refStepIn is refStepAt once a ghost past its time is gone.
func refStepIn(k refKey, c refCall, a refAnswer, now int64) []refNext {
	e, lapsed, expired := refEffective(k, now)
	var found []string
	if k.exists {
		switch {
		case lapsed:
			found = append(found, "IN_PROGRESS/lease runs out")
		case expired:
			found = append(found, rsNames[k.state]+"/expires_at passes")
			if k.ck.set {
				found = append(found, rsNames[k.state]+"/expires_at passes drops the checkpoint")
			}
		}
	}
	with := func(nexts []refNext) []refNext {
		for i := range nexts {
			nexts[i].labels = append(append([]string(nil), found...), nexts[i].labels...)
		}
		return nexts
	}
	switch c.kind {
	case rkLookup:
		switch {
		case a.unknown:
			return []refNext{{k: k}}
		case !k.exists:
			if a.err == "NOT_FOUND" {
				return []refNext{{k: k, labels: []string{"(none)/Lookup"}}}
			}
		case a.err == "" && a.rec != nil && viewMatches(e.view(), *a.rec):
			labels := []string{rsNames[e.state] + "/Lookup"}
			if e.ck.set {
				labels = append(labels, rsNames[e.state]+"/Lookup with checkpoint")
			}
			return with([]refNext{{k: k, labels: labels}})
		}
		return nil
	case rkReap:
		return refReap(k, e, c, a, now, found)
	case rkForget:
		if !k.exists {
			if a.unknown || a.err == "NOT_FOUND" {
				return []refNext{{k: k, labels: []string{"(none)/Forget"}}}
			}
			return nil
		}
		n := refNext{k: refKey{}, labels: []string{rsNames[e.state] + "/Forget"}}
		if e.state == rsCompleted || e.state == rsFailedReplayable {
			n.k = refKey{ghostUntil: c.end + int64(time.Second), ghostState: e.state, ghostFp: e.fp, ghostResp: e.resp,
				ghostAttempt: e.attempt, ghostGen: e.gen, ghostExpires: e.expires, ghostCk: e.ck}
		}
		if a.unknown {
			return []refNext{{k: k}, n}
		}
		if a.err == "" && a.rec != nil && viewMatches(answerView(e, c, a), *a.rec) {
			return with([]refNext{n})
		}
		return nil
	}
	cands := refDecide(k, e, c, now)
	if c.kind == rkBegin && k.ghostUntil != 0 && c.start < k.ghostUntil {
		// open: the replay cache may still answer from a forgotten
		// record (no replica replays it more than 1 s after
		// Forget returns).
		g := refKey{exists: true, state: k.ghostState, fp: k.ghostFp, resp: k.ghostResp, hasResp: true,
			attempt: k.ghostAttempt, gen: k.ghostGen, expires: k.ghostExpires, ck: k.ghostCk}
		ge, _, _ := refEffective(g, now)
		for _, d := range refBegin(g, ge, c, now) {
			if !d.write {
				d.next = k
				d.label, d.also = "forgotten/Begin from the replay cache", nil
				cands = append(cands, d)
			}
		}
	}
	var out []refNext
	for _, d := range cands {
		if a.unknown {
			out = append(out, refNext{k: k}) // not applied
			if d.err == "" && d.write {
				out = append(out, refNext{k: d.next})
			}
			continue
		}
		if d.err != "" {
			if a.err == d.err {
				out = append(out, refNext{k: k, labels: d.labels()})
			}
			continue
		}
		if a.err != "" {
			continue
		}
		next := d.next
		if c.kind == rkBegin {
			if a.outcome != d.outcome {
				continue
			}
			if d.outcome == roAcquired {
				if a.token == "" || (d.prevAlt == 0 && a.prev != d.prev) || (d.prevAlt != 0 && a.prev != d.prev && a.prev != d.prevAlt) {
					continue
				}
				switch {
				case d.newToken:
					// A new acquisition: its token differs from the
					// replaced one.
					if a.token == k.token {
						continue
					}
					next.token = a.token
				case isPlaceholder(next.token):
					// The token an unanswered Begin with this
					// attempt_id got: now it is known.
					next.token = a.token
				case next.token != a.token:
					continue
				}
			}
		}
		// Once ABANDONED deleted the record, what FailResponse.record
		// holds is open.
		if !d.deleted && (a.rec == nil || !viewMatches(answerView(d.answered, c, a), *a.rec)) {
			continue
		}
		out = append(out, refNext{k: next, labels: d.labels()})
	}
	if a.unknown {
		return out
	}
	return with(out)
}

// refDecision is one answer the table allows for a call, and the state it
// leaves.
type refDecision struct {
	err      string
	outcome  int
	prev     int
	prevAlt  int // open: a second previous_state the table allows
	newToken bool
	write    bool // the call changes the key when applied
	deleted  bool // the record is gone after it
	next     refKey
	answered refKey // the record the answer carries (when not deleted)
	label    string
	also     []string // further rows it exercises (the checkpoint's)
}

func (d refDecision) labels() []string { return append([]string{d.label}, d.also...) }

func refuse(reason, label string) refDecision { return refDecision{err: reason, label: label} }

// refDecide lists the answers the table allows for Begin, Complete, Fail,
// Heartbeat and Resolve on k (in effect e) at now.
func refDecide(k, e refKey, c refCall, now int64) []refDecision {
	switch c.kind {
	case rkBegin:
		return refBegin(k, e, c, now)
	case rkResolve:
		return refResolve(k, e, c, now)
	}
	return refFinish(k, e, c, now)
}

func refBegin(k, e refKey, c refCall, now int64) []refDecision {
	wait := ""
	if c.wait > 0 {
		wait = " (wait)"
	}
	acquire := func(n refKey, from int) refKey {
		n.exists = true
		n.state = rsInProgress
		n.attempt++
		n.token = placeholder(c.id)
		n.attemptID = c.attemptID
		n.prev = from
		n.ended = endNone
		n.endResp, n.endHasResp, n.endReason = "", false, ""
		n.resp, n.hasResp, n.reason = "", false, ""
		n.ttl, n.fttl = c.ttl, min(c.pol.failureTTL, c.ttl)
		n.lease = now + c.lease.Microseconds()
		n.expires = 0
		n.expiredFrom = 0
		n.ckMine = false // the generation's checkpoint, if any, is an earlier attempt's
		return n
	}
	if !k.exists {
		n := acquire(refKey{gen: 1, fp: c.fp}, rsNone)
		n.origin = originCreated
		return []refDecision{{outcome: roAcquired, prev: rsNone, newToken: true, write: true, next: n, answered: n, label: "(none)/Begin" + wait}}
	}
	if e.state == rsExpired {
		if c.pol.reject && (e.expiredFrom == rsCompleted || e.expiredFrom == rsFailedReplayable) {
			return []refDecision{refuse("KEY_EXPIRED", "EXPIRED from "+rsNames[e.expiredFrom]+"/Begin reject")}
		}
		n := e
		n.gen++
		n.attempt = 0
		n.fp = c.fp
		n.uncertain = false
		n.ck = refCheckpoint{} // a new generation starts without a checkpoint
		n = acquire(n, rsExpired)
		n.origin = originRestart
		label := "EXPIRED/Begin restart"
		if c.pol.reject {
			label = "EXPIRED from FAILED_RETRYABLE/Begin reject"
		}
		d := refDecision{outcome: roAcquired, prev: rsExpired, newToken: true, write: true, next: n, answered: n, label: label + wait}
		if k.ck.set {
			d.also = []string{"EXPIRED/Begin restart without the old generation's checkpoint"}
		}
		return []refDecision{d}
	}
	if c.fp != "" && e.fp != "" && c.fp != e.fp {
		return []refDecision{refuse("FINGERPRINT_MISMATCH", rsNames[e.state]+"/Begin other fingerprint")}
	}
	if c.attemptID != "" && c.attemptID == k.attemptID && k.ended == endNone {
		// The holder's Begin again: the same token, a full lease from now;
		// a fingerprint it brings is the generation's first if it had none.
		n := e
		n.state = rsInProgress
		n.lease = now + c.lease.Microseconds()
		if n.fp == "" {
			n.fp = c.fp
		}
		d := refDecision{outcome: roAcquired, prev: k.prev, write: true, next: n, answered: n,
			label: rsNames[e.state] + "/Begin same attempt_id"}
		if e.ck.set {
			d.also = []string{"Begin same attempt_id with checkpoint"}
		}
		if e.uncertain && k.prev != rsUnknown {
			// open: whether a repeated Begin after its own lease
			// lapsed answers the first previous_state or UNKNOWN.
			d.prevAlt = rsUnknown
		}
		return []refDecision{d}
	}
	exhausted := c.pol.maxAttempts > 0 && e.attempt >= c.pol.maxAttempts
	takeover := func(from int) refDecision {
		n := e
		origin := originTakeover
		if e.uncertain {
			from, origin = rsUnknown, originUncertain
		}
		if n.fp == "" {
			n.fp = c.fp
		}
		n = acquire(n, from)
		n.origin = origin
		label := rsNames[e.state] + "/Begin takeover"
		if e.state == rsFailedRetryable && e.uncertain {
			label = "FAILED_RETRYABLE uncertain/Begin takeover"
		}
		d := refDecision{outcome: roAcquired, prev: from, newToken: true, write: true, next: n, answered: n, label: label + wait}
		if e.ck.set {
			// The new attempt resumes after the generation's last step.
			d.also = []string{rsNames[e.state] + "/Begin takeover with checkpoint"}
		}
		return d
	}
	switch e.state {
	case rsInProgress:
		return []refDecision{{outcome: roInProgress, next: k, answered: e, label: "IN_PROGRESS/Begin" + wait}}
	case rsUnknown:
		hold := refDecision{outcome: roInProgress, next: k, answered: e, label: "UNKNOWN/Begin hold" + wait}
		exh := refuse("ATTEMPTS_EXHAUSTED", "UNKNOWN/Begin attempts exhausted")
		switch {
		case exhausted && c.pol.hold:
			// open: which of the two rows wins when both apply.
			return []refDecision{exh, hold}
		case exhausted:
			return []refDecision{exh}
		case c.pol.hold:
			return []refDecision{hold}
		}
		return []refDecision{takeover(rsUnknown)}
	case rsFailedRetryable:
		if exhausted {
			return []refDecision{refuse("ATTEMPTS_EXHAUSTED", "FAILED_RETRYABLE/Begin attempts exhausted")}
		}
		return []refDecision{takeover(rsFailedRetryable)}
	case rsCompleted, rsFailedReplayable:
		if len(c.accept) > 0 {
			sv := schemaVersionOf(e.resp)
			ok := false
			for _, a := range c.accept {
				ok = ok || a == sv
			}
			if !ok {
				return []refDecision{refuse("SCHEMA_VERSION_NOT_ACCEPTED", rsNames[e.state]+"/Begin schema version not accepted")}
			}
		}
		d := refDecision{outcome: roReplay, next: k, answered: e, label: rsNames[e.state] + "/Begin replay" + wait}
		if e.ck.set {
			d.also = []string{rsNames[e.state] + "/Begin replay with checkpoint"}
		}
		return []refDecision{d}
	}
	return nil
}

// refFinish decides Complete, Fail and Heartbeat.
func refFinish(k, e refKey, c refCall, now int64) []refDecision {
	name := rkNames[c.kind]
	if c.kind == rkFail {
		name += " " + rfNames[c.failKind]
	}
	if c.ckBad {
		// Bad input is refused before anything is read or written.
		return []refDecision{refuse("INVALID_ARGUMENT", "Heartbeat invalid checkpoint")}
	}
	// with adds the checkpoint's row to a Heartbeat's that carries one.
	with := func(d refDecision, row string) refDecision {
		if c.hasCk {
			d.also = append(d.also, row)
		}
		return d
	}
	if !k.exists {
		return []refDecision{refuse("NOT_FOUND", "(none)/"+name)}
	}
	if c.token == "" || c.token != k.token {
		// Fenced: a stale or taken-over token records no checkpoint.
		return []refDecision{with(refuse("LEASE_LOST", rsNames[e.state]+"/"+name+" other token"), rsNames[e.state]+"/Heartbeat checkpoint other token")}
	}
	if k.ended == endResolved {
		// open: the holder's token after an operator's Resolve is
		// refused, as LEASE_LOST or as ALREADY_FINISHED.
		return []refDecision{refuse("LEASE_LOST", "resolved/"+name), refuse("ALREADY_FINISHED", "resolved/"+name)}
	}
	if k.ended == endNone {
		return refApply(k, e, c, now)
	}
	// The acquisition ended with this token.
	if c.kind == rkHeartbeat {
		return []refDecision{with(refuse("ALREADY_FINISHED", "ended/Heartbeat"), "ended/Heartbeat checkpoint")}
	}
	same := false
	switch c.kind {
	case rkComplete:
		same = k.ended == endComplete && k.endResp == normResp(c)
	case rkFail:
		same = k.ended == endFail+c.failKind && k.endReason == c.reason && k.endResp == c.resp && k.endHasResp == c.hasResp
	}
	repeat := refDecision{next: k, answered: e, label: "ended/" + name + " repeated"}
	finished := refuse("ALREADY_FINISHED", "ended/"+name+" different")
	switch {
	case same && e.state == rsExpired:
		// open: repeating the ending call once the record expired.
		return []refDecision{repeat, finished}
	case same:
		return []refDecision{repeat}
	case (k.ended == endFail+rfUnknown || k.ended == endFail+rfAbandoned) && e.state == rsUnknown:
		// open: the state table lets Complete/Fail with the token end an
		// UNKNOWN record not yet taken over "as from IN_PROGRESS", while
		// its token rules call any other ending call after a Fail
		// ALREADY_FINISHED. Both are accepted after Fail UNKNOWN and
		// after an ABANDONED that went back to UNKNOWN.
		applied := refApply(k, e, c, now)
		for i := range applied {
			applied[i].label = "after Fail " + rfNames[k.ended-endFail] + "/" + name
		}
		return append(applied, finished)
	}
	return []refDecision{finished}
}

// refApply is an ending call or Heartbeat with the token of an acquisition
// that has not ended (IN_PROGRESS, or UNKNOWN by a lapsed lease).
func refApply(k, e refKey, c refCall, now int64) (out []refDecision) {
	from := rsNames[e.state]
	n := e
	n.ended = endNone
	n.lease = 0
	n.reason = ""
	setEnd := func(end int) {
		n.ended, n.endResp, n.endHasResp, n.endReason = end, c.resp, c.hasResp, c.reason
		if c.kind == rkComplete {
			n.endResp = normResp(c)
		}
	}
	upd := func(label string) refDecision {
		return refDecision{write: true, next: n, answered: n, label: from + "/" + label}
	}
	switch c.kind {
	case rkHeartbeat:
		n.state = rsInProgress
		n.lease = now + c.lease.Microseconds()
		if !c.hasCk {
			return []refDecision{upd("Heartbeat")}
		}
		// The step the holder finished: the generation's checkpoint now,
		// recorded by this acquisition, at the coordinator's time.
		n.ck = refCheckpoint{set: true, phase: c.ckPhase, data: c.ckData, at: now}
		n.ckMine = true
		d := upd("Heartbeat")
		d.also = []string{from + "/Heartbeat checkpoint"}
		return []refDecision{d}
	case rkComplete:
		n.state, n.resp, n.hasResp = rsCompleted, normResp(c), true
		n.expires = now + n.ttl.Microseconds()
		n.uncertain = false
		setEnd(endComplete)
		return []refDecision{upd("Complete")}
	}
	setEnd(endFail + c.failKind)
	fttl := now + n.fttl.Microseconds()
	switch c.failKind {
	case rfRetryable:
		n.state, n.expires, n.reason = rsFailedRetryable, fttl, c.reason
		if n.uncertain {
			// open (README): an uncertain FAILED_RETRYABLE never
			// expires, as UNKNOWN never does, so failure_ttl cannot
			// turn "an attempt may have acted" into a fresh generation.
			n.expires = 0
		}
		n.resp, n.hasResp = "", false
		return []refDecision{upd("Fail RETRYABLE")}
	case rfReplayable:
		n.state, n.expires, n.reason = rsFailedReplayable, fttl, c.reason
		n.resp, n.hasResp = normResp(c), true
		n.uncertain = false
		return []refDecision{upd("Fail REPLAYABLE")}
	case rfUnknown:
		n.state, n.expires, n.reason, n.uncertain = rsUnknown, 0, c.reason, true
		n.resp, n.hasResp = "", false
		return []refDecision{upd("Fail UNKNOWN")}
	case rfAbandoned:
		// The ABANDONED rows are the IN_PROGRESS row of the table, whether
		// the lease lapsed meanwhile or not.
		from = "IN_PROGRESS"
		if k.ckMine {
			// An acquisition that recorded a checkpoint has acted: it
			// cannot put the key back, and the record stays as it is.
			return []refDecision{refuse("CHECKPOINT_RECORDED", from+"/Fail ABANDONED after its own checkpoint")}
		}
		if e.ck.set {
			// An earlier attempt's checkpoint: the key goes back as
			// below, checkpoint kept (it belongs to the generation).
			defer func() {
				for i := range out {
					out[i].also = append(out[i].also, from+"/Fail ABANDONED keeps an earlier attempt's checkpoint")
				}
			}()
		}
		// "As before this acquisition", and a released acquisition does
		// not count against max_attempts: a takeover's attempt goes back
		// by one, unless the acquisition may have acted itself (it said
		// Fail UNKNOWN first, or its own lease lapsed).
		deleted := refDecision{write: true, deleted: true, label: from + "/Fail ABANDONED created"}
		retryable := n
		retryable.state, retryable.expires, retryable.fp, retryable.reason = rsFailedRetryable, fttl, "", c.reason
		retryable.resp, retryable.hasResp = "", false
		if retryable.uncertain {
			retryable.expires = 0 // as for Fail RETRYABLE
		}
		uncounted := retryable
		if uncounted.attempt > 1 {
			uncounted.attempt--
		}
		retry := refDecision{write: true, next: retryable, answered: retryable, label: from + "/Fail ABANDONED takeover"}
		released := refDecision{write: true, next: uncounted, answered: uncounted, label: from + "/Fail ABANDONED takeover"}
		unknown := n
		unknown.state, unknown.expires, unknown.reason = rsUnknown, 0, c.reason
		unknown.resp, unknown.hasResp = "", false
		back := refDecision{write: true, next: unknown, answered: unknown, label: from + "/Fail ABANDONED uncertain takeover"}
		switch {
		case k.origin == originUncertain:
			// (Not when this acquisition's ABANDONED gave its number
			// back already.)
			if k.ended != endFail+rfUnknown && k.ended != endFail+rfAbandoned && unknown.attempt > 1 {
				unknown.attempt--
				back.next, back.answered = unknown, unknown
			}
			return []refDecision{back}
		case e.uncertain:
			// open: an acquisition that became uncertain itself (its
			// lease lapsed) and is then abandoned must not look untouched;
			// the state table names no row for it, so UNKNOWN or an uncertain
			// FAILED_RETRYABLE are both accepted.
			keep := retryable
			keep.fp = e.fp
			back.label = from + "/Fail ABANDONED after own lapse"
			retry.label = back.label
			retry2 := retry
			retry2.next, retry2.answered = keep, keep
			return []refDecision{back, retry, retry2}
		case k.origin == originCreated:
			return []refDecision{deleted}
		case k.origin == originRestart:
			// EXPIRED again, in the generation before, as if expired
			// now; under on_expired: reject it was a failure (only
			// those restart), otherwise it is kept as a result.
			expired := n
			expired.state, expired.gen, expired.attempt, expired.fp = rsExpired, n.gen-1, 1, ""
			expired.expires, expired.reason, expired.resp, expired.hasResp = now, c.reason, "", false
			expired.ck, expired.ckMine = refCheckpoint{}, false
			expired.expiredFrom = rsCompleted
			if c.pol.reject {
				expired.expiredFrom = rsFailedRetryable
			}
			return []refDecision{{write: true, next: expired, answered: expired, label: from + "/Fail ABANDONED restart"}}
		}
		return []refDecision{released}
	}
	return nil
}

// refResolve decides Admin.Resolve.
func refResolve(k, e refKey, c refCall, now int64) []refDecision {
	as := map[int]string{rrCompleted: "COMPLETED", rrRetryable: "RETRYABLE"}[c.resolveAs]
	if !k.exists {
		return []refDecision{refuse("NOT_FOUND", "(none)/Resolve")}
	}
	from := rsNames[e.state]
	switch {
	case e.state == rsFailedRetryable && e.uncertain:
		// open (README): an uncertain FAILED_RETRYABLE needs a decision
		// like UNKNOWN (it never expires), so an operator may resolve it.
		from = "FAILED_RETRYABLE uncertain"
	case e.state != rsUnknown:
		return []refDecision{refuse("NOT_UNKNOWN", rsNames[e.state]+"/Resolve")}
	}
	n := e
	n.ended = endResolved
	n.lease = 0
	n.uncertain = false
	n.reason = ""
	n.attemptID = ""
	if c.resolveAs == rrCompleted {
		n.state, n.resp, n.hasResp, n.expires = rsCompleted, normResp(c), true, now+n.ttl.Microseconds()
	} else {
		n.state, n.resp, n.hasResp, n.expires = rsFailedRetryable, "", false, now+n.fttl.Microseconds()
	}
	return []refDecision{{write: true, next: n, answered: n, label: from + "/Resolve " + as}}
}

// refReap is one reaper pass over the key: the stored row catches up with
// the state in effect (invisible to callers), and an EXPIRED row past its
// retention is deleted, so the key is new again. The reaper skips rows
// locked by a call in flight (FOR UPDATE SKIP LOCKED), so a pass may leave
// the key as it was, whether it answered or not.
func refReap(k, e refKey, c refCall, a refAnswer, now int64, found []string) []refNext {
	if !k.exists {
		return []refNext{{k: k}}
	}
	caught := refNext{k: e}
	for _, l := range found {
		caught.labels = append(caught.labels, strings.Replace(l, "/", "/reaper: ", 1))
	}
	out := []refNext{{k: k}, caught}
	if e.state == rsExpired && e.expires+c.retention.Microseconds() <= now {
		out = append(out, refNext{k: refKey{}, labels: append(caught.labels, "EXPIRED/reaper deletes")})
	}
	return out
}

// normResp is the response a Complete, a Fail REPLAYABLE or a Resolve as
// COMPLETED stores: none sent stores an empty one.
func normResp(c refCall) string {
	if !c.hasResp {
		return canonicalResponse("", "", "", 0, nil)
	}
	return c.resp
}

// canonicalResponse writes a StoredResponse as a comparable string.
func canonicalResponse(schemaVersion, contentType, body string, code int32, md map[string]string) string {
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "{v=%q ct=%q body=%q code=%d md=[", schemaVersion, contentType, body, code)
	for _, k := range keys {
		fmt.Fprintf(&b, "%q:%q ", k, md[k])
	}
	b.WriteString("]}")
	return b.String()
}

func schemaVersionOf(canonical string) string {
	var v string
	_, _ = fmt.Sscanf(canonical, "{v=%q", &v)
	return v
}

// refModel is the reference model as a porcupine model, partitioned by key.
func refModel() porcupine.Model {
	seed := maphash.MakeSeed()
	nm := porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byKey := map[string][]porcupine.Operation{}
			var order []string
			for _, op := range history {
				in := op.Input.(refCall)
				k := in.scope + "/" + in.key
				if _, ok := byKey[k]; !ok {
					order = append(order, k)
				}
				byKey[k] = append(byKey[k], op)
			}
			out := make([][]porcupine.Operation, 0, len(order))
			for _, k := range order {
				out = append(out, byKey[k])
			}
			return out
		},
		Init: func() []any { return []any{refKey{}} },
		Step: func(state, input, output any) []any {
			nexts := refStep(state.(refKey), input.(refCall), output.(refAnswer))
			out := make([]any, 0, len(nexts))
			for _, n := range nexts {
				out = append(out, n.k)
			}
			return out
		},
		Equal: func(a, b any) bool { return a.(refKey) == b.(refKey) },
		// Without a hash porcupine files every state reached with the same
		// set of linearized calls in one bucket and compares a new state
		// with each: slow exactly when the search branches most.
		Hash:              func(s any) uint64 { return maphash.Comparable(seed, s.(refKey)) },
		DescribeOperation: func(input, output any) string { return describeRefCall(input.(refCall), output.(refAnswer)) },
		DescribeState:     func(state any) string { return state.(refKey).String() },
	}
	return nm.ToModel()
}

func describeRefCall(c refCall, a refAnswer) string {
	var args string
	switch c.kind {
	case rkBegin:
		args = fmt.Sprintf("fp=%q aid=%q lease=%v ttl=%v wait=%v accept=%v", c.fp, c.attemptID, c.lease, c.ttl, c.wait, c.accept)
	case rkComplete:
		args = fmt.Sprintf("tok=%.14s resp=%s", c.token, c.resp)
	case rkFail:
		args = fmt.Sprintf("tok=%.14s kind=%s resp=%s reason=%q", c.token, rfNames[c.failKind], c.resp, c.reason)
	case rkHeartbeat:
		args = fmt.Sprintf("tok=%.14s lease=%v", c.token, c.lease)
		if c.hasCk {
			args += " ckpt=" + refCheckpoint{set: true, phase: c.ckPhase, data: c.ckData}.String()
			if c.ckBad {
				args += " (out of bounds)"
			}
		}
	case rkResolve:
		args = fmt.Sprintf("as=%d", c.resolveAs)
	case rkReap:
		args = fmt.Sprintf("retention=%v", c.retention)
	}
	var res string
	switch {
	case a.unknown:
		res = "no answer"
	case a.err != "":
		res = a.err
	case c.kind == rkBegin:
		res = fmt.Sprintf("outcome=%d tok=%.14s prev=%s", a.outcome, a.token, rsNames[a.prev])
	default:
		res = "OK"
	}
	if a.rec != nil {
		res += " " + a.rec.String()
	}
	nows := make([]string, len(c.nows))
	for i, n := range c.nows {
		nows[i] = n.Format("05.000")
	}
	return fmt.Sprintf("c%d %s(%s/%s @%s %s) -> %s", c.client, rkNames[c.kind], c.scope, c.key, strings.Join(nows, "|"), args, res)
}

// refCoverage replays a linearization the checker found and counts the
// table rows it exercised (a row counts for a call when every state the
// key may be in before it leads through that row), the unanswered calls
// whose effect the rest of the history shows (the commit-done, reply-lost
// window) and the reaper deletions it shows.
func refCoverage(lin [][]porcupine.Operation) (rows map[string]int, lostReplies, reaperDeletes int) {
	rows = map[string]int{}
	type path struct {
		k refKey
		// applied: unanswered calls applied, and reaper passes that
		// deleted, on every way to k.
		applied map[int]bool
	}
	for _, ops := range lin {
		paths := []path{{k: refKey{}, applied: map[int]bool{}}}
		reaps := map[int]bool{}
		for _, op := range ops {
			c, a := op.Input.(refCall), op.Output.(refAnswer)
			if c.kind == rkReap {
				reaps[c.id] = true
			}
			var common map[string]bool
			var next []path
			for _, p := range paths {
				mine := map[string]bool{}
				for _, n := range refStep(p.k, c, a) {
					for _, l := range n.labels {
						mine[l] = true
					}
					applied := p.applied
					tracked := (a.unknown && c.kind != rkReap && n.k != p.k) || (c.kind == rkReap && p.k.exists && !n.k.exists)
					if tracked {
						applied = map[int]bool{c.id: true}
						for id := range p.applied {
							applied[id] = true
						}
					}
					merged := false
					for i := range next {
						if next[i].k == n.k {
							next[i].applied = intersect(next[i].applied, applied)
							merged = true
							break
						}
					}
					if !merged {
						next = append(next, path{k: n.k, applied: applied})
					}
				}
				if common == nil {
					common = mine
				} else {
					for l := range common {
						if !mine[l] {
							delete(common, l)
						}
					}
				}
			}
			if !a.unknown {
				for l := range common {
					rows[l]++
				}
			}
			if len(next) == 0 {
				break // cannot happen for a linearization the checker accepted
			}
			paths = next
		}
		common := paths[0].applied
		for _, p := range paths[1:] {
			common = intersect(common, p.applied)
		}
		for id := range common {
			if reaps[id] {
				reaperDeletes++
			} else {
				lostReplies++
			}
		}
	}
	rows["EXPIRED/reaper deletes"] = reaperDeletes
	return rows, lostReplies, reaperDeletes
}

func intersect(a, b map[int]bool) map[int]bool {
	out := map[int]bool{}
	for id := range a {
		if b[id] {
			out[id] = true
		}
	}
	return out
}

// refCheckpointRows are the checkpoint's rules, as the labels refStep
// gives them besides the table's row: recorded by the holder (also after its
// lease lapsed), fenced for other tokens, refused after the end and out of
// bounds, returned to the next acquiring Begin of the generation, replayed
// and read with the result, dropped at expiry and absent from a new
// generation, and Fail ABANDONED refused after the acquisition's own
// checkpoint but not after an earlier attempt's.
var refCheckpointRows = []string{
	"IN_PROGRESS/Heartbeat checkpoint",
	"UNKNOWN/Heartbeat checkpoint",
	"IN_PROGRESS/Heartbeat checkpoint other token",
	"ended/Heartbeat checkpoint",
	"Heartbeat invalid checkpoint",
	"FAILED_RETRYABLE/Begin takeover with checkpoint",
	"UNKNOWN/Begin takeover with checkpoint",
	"COMPLETED/Begin replay with checkpoint",
	"COMPLETED/Lookup with checkpoint",
	"COMPLETED/expires_at passes drops the checkpoint",
	"EXPIRED/Begin restart without the old generation's checkpoint",
	"IN_PROGRESS/Fail ABANDONED after its own checkpoint",
	"IN_PROGRESS/Fail ABANDONED keeps an earlier attempt's checkpoint",
}

// refTableRows are the rows of the state table (docs/concepts.md), as the labels
// refStep gives them, and the checkpoint's rules; TestLinearizableReference
// fails unless each is exercised.
var refTableRows = append([]string{
	"(none)/Begin",
	"IN_PROGRESS/Begin",
	"IN_PROGRESS/Begin (wait)",
	"IN_PROGRESS/Begin same attempt_id",
	"UNKNOWN/Begin same attempt_id",
	"IN_PROGRESS/Complete",
	"IN_PROGRESS/Fail RETRYABLE",
	"IN_PROGRESS/Fail REPLAYABLE",
	"IN_PROGRESS/Fail UNKNOWN",
	"IN_PROGRESS/Fail ABANDONED created",
	"IN_PROGRESS/Fail ABANDONED takeover",
	"IN_PROGRESS/Fail ABANDONED uncertain takeover",
	"IN_PROGRESS/lease runs out",
	"IN_PROGRESS/reaper: lease runs out",
	"IN_PROGRESS/Heartbeat",
	"UNKNOWN/Heartbeat",
	"ended/Heartbeat",
	"UNKNOWN/Complete",
	"UNKNOWN/Fail RETRYABLE",
	"UNKNOWN/Fail REPLAYABLE",
	"UNKNOWN/Fail UNKNOWN",
	"ended/Complete repeated",
	"ended/Complete different",
	"ended/Fail RETRYABLE repeated",
	"ended/Fail REPLAYABLE repeated",
	"ended/Fail REPLAYABLE different",
	"IN_PROGRESS/Complete other token",
	"COMPLETED/Begin replay",
	"FAILED_REPLAYABLE/Begin replay",
	"COMPLETED/Begin other fingerprint",
	"COMPLETED/Begin schema version not accepted",
	"FAILED_RETRYABLE/Begin takeover",
	"FAILED_RETRYABLE uncertain/Begin takeover",
	"FAILED_RETRYABLE/Begin attempts exhausted",
	"UNKNOWN/Begin attempts exhausted",
	"UNKNOWN/Begin takeover",
	"UNKNOWN/Begin hold",
	"COMPLETED/expires_at passes",
	"FAILED_RETRYABLE/expires_at passes",
	"FAILED_REPLAYABLE/expires_at passes",
	"COMPLETED/reaper: expires_at passes",
	"EXPIRED/Begin restart",
	"EXPIRED from COMPLETED/Begin reject",
	"EXPIRED from FAILED_REPLAYABLE/Begin reject",
	"EXPIRED from FAILED_RETRYABLE/Begin reject",
	"EXPIRED/reaper deletes",
	"UNKNOWN/Resolve COMPLETED",
	"UNKNOWN/Resolve RETRYABLE",
	"COMPLETED/Resolve",
	"IN_PROGRESS/Forget",
	"COMPLETED/Forget",
	"UNKNOWN/Forget",
	"(none)/Lookup",
}, refCheckpointRows...)
