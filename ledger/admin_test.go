package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// newClockedStore opens a store over a fresh database with a test clock.
func newClockedStore(t *testing.T) (*ledger.Store, *coordtest.Clock, string) {
	t.Helper()
	url := pgtest.NewDatabase(t)
	clock := coordtest.NewClock()
	return openStore(t, url, clock), clock, url
}

// beginID acquires a new record and returns its lease token.
func beginID(t *testing.T, s *ledger.Store, id ledger.Identity, lease, ttl time.Duration) string {
	t.Helper()
	res, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id,
		Event: statemachine.Event{TTL: ttl, FailureTTL: ttl / 2, Lease: lease}})
	if err != nil || res.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("Begin %v: %v %v", id, res, err)
	}
	return res.Record.LeaseToken
}

func completeID(t *testing.T, s *ledger.Store, id ledger.Identity, token string) {
	t.Helper()
	if _, err := s.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: token, Response: &statemachine.Response{Body: []byte("done")}}}); err != nil {
		t.Fatalf("Complete %v: %v", id, err)
	}
}

// subscribeListening subscribes to id's changes and waits until the
// store's change listener is connected (it wakes every subscriber once when
// it connects), so a wake-up after that is a notification.
func subscribeListening(t *testing.T, s *ledger.Store, id ledger.Identity) <-chan struct{} {
	t.Helper()
	changed, unsubscribe := s.Subscribe(id)
	t.Cleanup(unsubscribe)
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("the change listener did not connect")
	}
	// As a waiting Begin does: only waited-for records are notified.
	if held, err := s.Watch(context.Background(), id); err != nil || !held {
		t.Fatalf("Watch %v: held %v, %v", id, held, err)
	}
	return changed
}

// listAll follows every page of p with the given page size.
func listAll(t *testing.T, s *ledger.Store, p ledger.ListParams, pageSize int) []ledger.ListedRecord {
	t.Helper()
	p.Limit = pageSize
	var out []ledger.ListedRecord
	for range 100 {
		res, err := s.ListRecords(context.Background(), &p)
		if err != nil {
			t.Fatalf("ListRecords %+v: %v", p, err)
		}
		if len(res.Records) > pageSize {
			t.Fatalf("page of %d records, limit %d", len(res.Records), pageSize)
		}
		out = append(out, res.Records...)
		if !res.More {
			return out
		}
		last := res.Records[len(res.Records)-1].RecordKey
		p.After = &last
	}
	t.Fatal("more than 100 pages")
	return nil
}

func names(recs []ledger.ListedRecord) []string {
	var out []string
	for _, r := range recs {
		out = append(out, r.Scope+" "+r.Key+" "+r.Record.State.String())
	}
	return out
}

// TestListRecords lists one tenant's records page by page in (scope, key)
// order, filtered by the state in effect now and by a scope glob.
func TestListRecords(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	id := func(scope, key string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: scope, Key: key} }

	// Lease 10s: these holders vanish.
	beginID(t, s, id("b/x", "lapsed-1"), 10*time.Second, time.Hour)
	beginID(t, s, id("a", "lapsed-2"), 10*time.Second, time.Hour)
	// Completed with ttl 20s: expired by the time the list runs.
	completeID(t, s, id("b/y", "gone"), beginID(t, s, id("b/y", "gone"), time.Minute, 20*time.Second))
	// Live records.
	beginID(t, s, id("b/y", "held"), time.Hour, time.Hour)
	completeID(t, s, id("a", "done"), beginID(t, s, id("a", "done"), time.Minute, time.Hour))
	completeID(t, s, id("c_%", "done"), beginID(t, s, id("c_%", "done"), time.Minute, time.Hour))
	completeID(t, s, id("cx%", "done"), beginID(t, s, id("cx%", "done"), time.Minute, time.Hour))
	// Another tenant's record is never listed.
	beginID(t, s, ledger.Identity{Tenant: "other", Scope: "a", Key: "theirs"}, 10*time.Second, time.Hour)
	clock.Advance(30 * time.Second)

	all := []string{"a done COMPLETED", "a lapsed-2 UNKNOWN", "b/x lapsed-1 UNKNOWN", "b/y gone EXPIRED",
		"b/y held IN_PROGRESS", "c_% done COMPLETED", "cx% done COMPLETED"}
	for _, size := range []int{1, 2, 3, 100} {
		if got := names(listAll(t, s, ledger.ListParams{Tenant: "t"}, size)); !slices.Equal(got, all) {
			t.Fatalf("page size %d:\n got  %q\n want %q", size, got, all)
		}
	}
	for _, c := range []struct {
		state statemachine.State
		glob  string
		want  []string
	}{
		{statemachine.StateUnknown, "", []string{"a lapsed-2 UNKNOWN", "b/x lapsed-1 UNKNOWN"}},
		{statemachine.StateInProgress, "", []string{"b/y held IN_PROGRESS"}},
		{statemachine.StateExpired, "", []string{"b/y gone EXPIRED"}},
		{statemachine.StateCompleted, "", []string{"a done COMPLETED", "c_% done COMPLETED", "cx% done COMPLETED"}},
		{statemachine.StateFailedRetryable, "", nil},
		{statemachine.StateNone, "b/*", []string{"b/x lapsed-1 UNKNOWN", "b/y gone EXPIRED", "b/y held IN_PROGRESS"}},
		{statemachine.StateNone, "*", all},
		{statemachine.StateNone, "b", nil},
		{statemachine.StateNone, "*x", []string{"b/x lapsed-1 UNKNOWN"}},
		{statemachine.StateUnknown, "b*", []string{"b/x lapsed-1 UNKNOWN"}},
		// LIKE's own wildcards match only themselves.
		{statemachine.StateNone, "c_%", []string{"c_% done COMPLETED"}},
		{statemachine.StateNone, "c_*", []string{"c_% done COMPLETED"}},
	} {
		got := names(listAll(t, s, ledger.ListParams{Tenant: "t", State: c.state, ScopeGlob: c.glob}, 1))
		if !slices.Equal(got, c.want) {
			t.Errorf("state %v glob %q:\n got  %q\n want %q", c.state, c.glob, got, c.want)
		}
	}
	for _, r := range listAll(t, s, ledger.ListParams{Tenant: "t"}, 100) {
		if r.Record.Response != nil {
			t.Errorf("%s %s listed with a response", r.Scope, r.Key)
		}
	}
	if got := names(listAll(t, s, ledger.ListParams{Tenant: "nobody"}, 10)); got != nil {
		t.Errorf("an unknown tenant lists %q", got)
	}
	for _, c := range []struct {
		state  statemachine.State
		glob   string
		prefix string
		want   []string
	}{
		{statemachine.StateNone, "", "lapsed-", []string{"a lapsed-2 UNKNOWN", "b/x lapsed-1 UNKNOWN"}},
		{statemachine.StateNone, "b/*", "lapsed", []string{"b/x lapsed-1 UNKNOWN"}},
		{statemachine.StateUnknown, "", "lapsed-2", []string{"a lapsed-2 UNKNOWN"}},
		{statemachine.StateCompleted, "", "lapsed", nil},
		{statemachine.StateNone, "", "done", []string{"a done COMPLETED", "c_% done COMPLETED", "cx% done COMPLETED"}},
		// The prefix is bytes, not a pattern.
		{statemachine.StateNone, "", "%", nil},
		{statemachine.StateNone, "", "d_ne", nil},
		{statemachine.StateNone, "", "theirs", nil},
	} {
		got := names(listAll(t, s, ledger.ListParams{Tenant: "t", State: c.state, ScopeGlob: c.glob, KeyPrefix: c.prefix}, 1))
		if !slices.Equal(got, c.want) {
			t.Errorf("state %v glob %q prefix %q:\n got  %q\n want %q", c.state, c.glob, c.prefix, got, c.want)
		}
	}

	// Counts by scope and state in effect now, this tenant only.
	counts, err := s.CountRecords(context.Background(), &ledger.CountParams{Tenant: "t", MaxGroups: 100})
	if err != nil {
		t.Fatal(err)
	}
	var gotCounts []string
	for _, c := range counts.Counts {
		gotCounts = append(gotCounts, fmt.Sprintf("%s %v %d", c.Scope, c.State, c.Count))
	}
	wantCounts := []string{"a COMPLETED 1", "a UNKNOWN 1", "b/x UNKNOWN 1", "b/y IN_PROGRESS 1", "b/y EXPIRED 1",
		"c_% COMPLETED 1", "cx% COMPLETED 1"}
	if !slices.Equal(gotCounts, wantCounts) || counts.Truncated {
		t.Errorf("CountRecords:\n got  %q (truncated %v)\n want %q", gotCounts, counts.Truncated, wantCounts)
	}
	counts, err = s.CountRecords(context.Background(), &ledger.CountParams{Tenant: "t", MaxGroups: 2})
	if err != nil || len(counts.Counts) != 2 || !counts.Truncated {
		t.Errorf("CountRecords with MaxGroups 2: %+v, %v; want 2 groups, truncated", counts, err)
	}
	counts, err = s.CountRecords(context.Background(), &ledger.CountParams{Tenant: "nobody", MaxGroups: 10})
	if err != nil || len(counts.Counts) != 0 || counts.Truncated {
		t.Errorf("CountRecords of an unknown tenant: %+v, %v", counts, err)
	}
}

// TestEffectiveStateSQL checks that the state filter of ListRecords reads
// each record as statemachine.Effective does (what Lookup reports), at the
// exact instants where a lease or a retention runs out.
func TestEffectiveStateSQL(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	var ids []ledger.Identity
	for i, d := range []time.Duration{-time.Microsecond, 0, time.Microsecond} {
		// Leases and retentions that end 1µs before, at, and 1µs after the
		// instant the list is taken.
		lease := ledger.Identity{Tenant: "t", Scope: "lease", Key: fmt.Sprint(i)}
		beginID(t, s, lease, time.Minute+d, time.Hour)
		ret := ledger.Identity{Tenant: "t", Scope: "ttl", Key: fmt.Sprint(i)}
		completeID(t, s, ret, beginID(t, s, ret, time.Hour, time.Minute+d))
		ids = append(ids, lease, ret)
	}
	clock.Advance(time.Minute)
	byState := map[string]statemachine.State{}
	for st := statemachine.StateInProgress; st <= statemachine.StateUnknown; st++ {
		for _, r := range listAll(t, s, ledger.ListParams{Tenant: "t", State: st}, 100) {
			byState[r.Scope+"/"+r.Key] = st
			if r.Record.State != st {
				t.Errorf("%s/%s listed under %v reads %v", r.Scope, r.Key, st, r.Record.State)
			}
		}
	}
	for _, id := range ids {
		rec, _, err := s.Lookup(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if got := byState[id.Scope+"/"+id.Key]; got != rec.State {
			t.Errorf("%s/%s: listed under %v, Lookup reads %v", id.Scope, id.Key, got, rec.State)
		}
	}
	if byState["lease/1"] != statemachine.StateUnknown || byState["ttl/1"] != statemachine.StateExpired ||
		byState["lease/2"] != statemachine.StateInProgress {
		t.Errorf("boundaries: %v", byState)
	}
}

// TestResolve ends records whose holder vanished, under the row lock, and
// wakes waiting Begins.
func TestResolve(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	lapsed := ledger.Identity{Tenant: "t", Scope: "s", Key: "lapsed"}
	retry := ledger.Identity{Tenant: "t", Scope: "s", Key: "retry"}
	tok := beginID(t, s, lapsed, 10*time.Second, time.Hour)
	retryTok := beginID(t, s, retry, time.Hour, time.Hour)
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: retry, Event: statemachine.Event{
		Kind: statemachine.EventFail, Token: retryTok, FailureKind: statemachine.FailureUnknown}}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Minute)

	changed := subscribeListening(t, s, lapsed)
	resp := &statemachine.Response{SchemaVersion: "v/1", Body: []byte("reconciled"), StatusCode: 200}
	res, err := s.Resolve(ctx, &ledger.ResolveParams{ID: lapsed, As: statemachine.StateCompleted, Response: resp})
	if err != nil {
		t.Fatal(err)
	}
	if res.Record.State != statemachine.StateCompleted || !res.Record.ExpiresAt.Equal(clock.Now().Add(time.Hour)) {
		t.Fatalf("resolved: %+v", res.Record)
	}
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("Resolve did not notify the record's subscribers")
	}
	rec, _, err := s.Lookup(ctx, lapsed)
	if err != nil || rec.State != statemachine.StateCompleted || !rec.Response.Equal(resp) {
		t.Fatalf("after Resolve: %+v %v", rec, err)
	}
	// The vanished holder's token no longer works.
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: lapsed, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: tok}}); !errors.Is(err, statemachine.ErrLeaseLost) {
		t.Fatalf("the holder's Complete after Resolve: %v, want ErrLeaseLost", err)
	}
	// A record that is not UNKNOWN is refused; a missing one is not found.
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: lapsed, As: statemachine.StateFailedRetryable}); !errors.Is(err, statemachine.ErrNotUnknown) {
		t.Fatalf("Resolve of a COMPLETED record: %v", err)
	}
	missing := ledger.Identity{Tenant: "other", Scope: "s", Key: "retry"}
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: missing, As: statemachine.StateCompleted}); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("Resolve of another tenant's key: %v", err)
	}

	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: retry, As: statemachine.StateFailedRetryable}); err != nil {
		t.Fatal(err)
	}
	b, err := s.Begin(ctx, &ledger.BeginParams{ID: retry, Event: statemachine.Event{TTL: time.Hour, Lease: time.Minute}})
	if err != nil || b.Outcome != statemachine.OutcomeAcquired || b.PreviousState != statemachine.StateFailedRetryable || b.Record.Attempt != 2 {
		t.Fatalf("Begin after Resolve as retryable: %+v %v", b, err)
	}
}

// TestForget deletes a record in any state, once, within its tenant.
func TestForget(t *testing.T) {
	t.Parallel()
	s, clock, url := newClockedStore(t)
	ctx := context.Background()
	held := ledger.Identity{Tenant: "t", Scope: "s", Key: "held"}
	done := ledger.Identity{Tenant: "t", Scope: "s", Key: "done"}
	tok := beginID(t, s, held, time.Hour, time.Hour)
	completeID(t, s, done, beginID(t, s, done, time.Hour, time.Hour))

	if _, err := s.Forget(ctx, &ledger.ForgetParams{ID: ledger.Identity{Tenant: "other", Scope: "s", Key: "held"}}); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("Forget of another tenant's key: %v", err)
	}
	changed := subscribeListening(t, s, held)
	rec, err := s.Forget(ctx, &ledger.ForgetParams{ID: held})
	if err != nil || rec.State != statemachine.StateInProgress || rec.LeaseToken != tok {
		t.Fatalf("Forget of a held record: %+v %v", rec, err)
	}
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("Forget did not notify the record's subscribers")
	}
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: held, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: tok}}); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("the holder's Complete after Forget: %v", err)
	}
	if _, err := s.Forget(ctx, &ledger.ForgetParams{ID: held}); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("second Forget: %v", err)
	}
	clock.Advance(2 * time.Hour) // past expires_at: reads EXPIRED, without response
	rec, err = s.Forget(ctx, &ledger.ForgetParams{ID: done})
	if err != nil || rec.State != statemachine.StateExpired || rec.Response != nil {
		t.Fatalf("Forget of an expired record: %+v %v", rec, err)
	}
	if got := storedStates(t, url); len(got) != 0 {
		t.Fatalf("records left: %v", got)
	}
	b, err := s.Begin(ctx, &ledger.BeginParams{ID: held, Event: statemachine.Event{TTL: time.Hour, Lease: time.Minute}})
	if err != nil || b.Outcome != statemachine.OutcomeAcquired || b.PreviousState != statemachine.StateNone || b.Record.Attempt != 1 {
		t.Fatalf("Begin after Forget: %+v %v", b, err)
	}
}

// TestListRecordsNeedsDecision lists only the records that wait for an
// operator: UNKNOWN in effect now (a lapsed lease included) and uncertain
// FAILED_RETRYABLE (which never expires, so it stays listed past its
// failure_ttl), never a plain FAILED_RETRYABLE, a live lease or a COMPLETED
// record.
func TestListRecordsNeedsDecision(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	id := func(key string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: key} }
	fail := func(key, token string, kind statemachine.FailureKind) {
		t.Helper()
		if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id(key), Event: statemachine.Event{
			Kind: statemachine.EventFail, Token: token, FailureKind: kind}}); err != nil {
			t.Fatalf("Fail %s: %v", key, err)
		}
	}
	// uncertainRetryable: Fail UNKNOWN, a takeover, then Fail RETRYABLE
	// with failure_ttl ttl/2.
	uncertainRetryable := func(key string, ttl time.Duration) {
		t.Helper()
		fail(key, beginID(t, s, id(key), time.Hour, ttl), statemachine.FailureUnknown)
		fail(key, beginID(t, s, id(key), time.Hour, ttl), statemachine.FailureRetryable)
	}
	uncertainRetryable("past-failure-ttl", 20*time.Second)
	beginID(t, s, id("lapsed"), 10*time.Second, time.Hour)
	fail("failed-unknown", beginID(t, s, id("failed-unknown"), time.Hour, time.Hour), statemachine.FailureUnknown)
	uncertainRetryable("uncertain-retryable", time.Hour)
	fail("retryable", beginID(t, s, id("retryable"), time.Hour, time.Hour), statemachine.FailureRetryable)
	completeID(t, s, id("completed"), beginID(t, s, id("completed"), time.Hour, time.Hour))
	beginID(t, s, id("held"), time.Hour, time.Hour)
	beginID(t, s, ledger.Identity{Tenant: "other", Scope: "s", Key: "lapsed"}, 10*time.Second, time.Hour)
	clock.Advance(30 * time.Second)

	want := []string{"s failed-unknown UNKNOWN", "s lapsed UNKNOWN", "s past-failure-ttl FAILED_RETRYABLE",
		"s uncertain-retryable FAILED_RETRYABLE"}
	for _, size := range []int{1, 100} {
		if got := names(listAll(t, s, ledger.ListParams{Tenant: "t", NeedsDecision: true}, size)); !slices.Equal(got, want) {
			t.Fatalf("page size %d:\n got  %q\n want %q", size, got, want)
		}
	}
	for _, c := range []struct {
		state statemachine.State
		want  []string
	}{
		{statemachine.StateUnknown, want[:2]},
		{statemachine.StateFailedRetryable, want[2:]},
		{statemachine.StateCompleted, nil},
	} {
		got := names(listAll(t, s, ledger.ListParams{Tenant: "t", NeedsDecision: true, State: c.state}, 10))
		if !slices.Equal(got, c.want) {
			t.Errorf("state %v:\n got  %q\n want %q", c.state, got, c.want)
		}
	}
}
