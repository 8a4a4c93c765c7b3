package ledger

import (
	"context"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// ReleaseReason is the failure reason of the Fail ABANDONED with which a
// Begin ends an acquisition it made for a caller that had gone (see
// Store.Begin). It is the reason the client libraries release with
// (clients.ReleaseReason), so a released acquisition reads the same
// whoever released it.
const ReleaseReason = "caller gave up before the handler ran"

// releaseTimeout bounds the release of one acquisition whose caller has
// gone.
const releaseTimeout = 5 * time.Second

// madeBy reports whether res is an acquisition that the Begin offering
// token made: a new record, a takeover or a restart, written with that
// token. (A repeated Begin of the holder's attempt, answered with the
// holder's token, is not one.)
func madeBy(res *Result, token string) bool {
	return res != nil && res.Err == nil && res.Outcome == statemachine.OutcomeAcquired &&
		res.Write != statemachine.WriteNone && res.Record.LeaseToken == token
}

// releaseGone ends with Fail ABANDONED, reason ReleaseReason, the
// acquisition rec that a Begin of p made for a caller that had gone, on a
// context of its own (ctx's values, bounded by releaseTimeout). It ends it
// only while the record is as that Begin wrote it (same token, same
// updated_at): a repeated Begin of the same attempt_id, or a Heartbeat,
// since then means that a caller holds it. Once the Store is closing it
// does nothing.
func (s *Store) releaseGone(ctx context.Context, p *BeginParams, rec statemachine.Record) {
	s.releasesMu.Lock()
	if s.releasesClosed {
		s.releasesMu.Unlock()
		return
	}
	s.releases.Add(1)
	s.releasesMu.Unlock()
	defer s.releases.Done()

	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	ev := statemachine.Event{Kind: statemachine.EventFail, Token: rec.LeaseToken,
		FailureKind: statemachine.FailureAbandoned, Reason: ReleaseReason}
	res, err := s.lockedWith(ctx, p.ID, ev, p.Policy, lockedHooks{only: func(cur *statemachine.Record) bool {
		return cur != nil && cur.LeaseToken == rec.LeaseToken && cur.UpdatedAt.Equal(rec.UpdatedAt)
	}})
	switch {
	case err != nil:
		s.logger.WarnContext(ctx, "could not release an acquisition whose Begin's caller had gone; "+
			"the key reads UNKNOWN once its lease runs out",
			"tenant", p.ID.Tenant, "scope", p.ID.Scope, "key", p.ID.Key, "err", err)
	case res != nil:
		s.logger.InfoContext(ctx, "released an acquisition whose Begin's caller had gone",
			"tenant", p.ID.Tenant, "scope", p.ID.Scope, "key", p.ID.Key)
	}
}

// waitReleases stops new releases of acquisitions whose caller has gone
// and waits for those under way.
func (s *Store) waitReleases() {
	s.releasesMu.Lock()
	s.releasesClosed = true
	s.releasesMu.Unlock()
	s.releases.Wait()
}
