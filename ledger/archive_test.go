package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestArchivePagesAndBatches archives more UNKNOWN records than one batch
// holds, one key twice, and pages through the archive one record at a
// time: every archived record appears once, with its metadata (fingerprint
// and failure reason) kept; an ended record is never archived.
func TestArchivePagesAndBatches(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	id := func(k string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: k} }
	begin := func(k string, lease time.Duration) string {
		res, err := s.Begin(ctx, &ledger.BeginParams{ID: id(k), Event: statemachine.Event{
			Fingerprint: []byte("fp-" + k), TTL: time.Hour, FailureTTL: time.Hour, Lease: lease}})
		if err != nil || res.Outcome != statemachine.OutcomeAcquired {
			t.Fatalf("Begin %s: %+v %v", k, res, err)
		}
		return res.Record.LeaseToken
	}
	for i := range 5 {
		begin(fmt.Sprintf("lapsed-%d", i), time.Second)
	}
	tok := begin("failed-unknown", time.Hour)
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id("failed-unknown"), Event: statemachine.Event{
		Kind: statemachine.EventFail, Token: tok, FailureKind: statemachine.FailureUnknown, Reason: "timeout talking to the bank"}}); err != nil {
		t.Fatal(err)
	}
	completeID(t, s, id("completed"), begin("completed", time.Second))
	reap := func() ledger.ReapResult {
		t.Helper()
		res, err := s.Reap(ctx, &ledger.ReapParams{BatchSize: 2, UnknownRetention: 24 * time.Hour,
			ScopeRetention: []ledger.ScopeRetention{{Glob: "never*", Retention: 1000 * time.Hour}}})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	// An UNKNOWN record's age counts from when it became UNKNOWN: Fail
	// UNKNOWN at 0h; the lapsed leases when this first pass marks them
	// (23h); a lapsed lease not yet marked, from its end.
	clock.Advance(23 * time.Hour)
	if res := reap(); res.Archived != 0 || res.Unknown != 5 {
		t.Fatalf("at 23h: %+v, want nothing archived and 5 leases marked UNKNOWN", res)
	}
	clock.Advance(2 * time.Hour)
	begin("held", time.Hour)
	if res := reap(); res.Archived != 1 || res.ArchivedScopes[0] != "s" {
		t.Fatalf("at 25h: archived %d (%v), want failed-unknown", res.Archived, res.ArchivedScopes)
	}
	clock.Advance(24 * time.Hour)
	if res := reap(); res.Archived != 5 { // the lapsed ones, in batches of 2
		t.Fatalf("at 49h: archived %d, want 5", res.Archived)
	}
	begin("lapsed-0", time.Second) // the key is new again
	clock.Advance(25 * time.Hour)
	if res := reap(); res.Archived != 2 { // lapsed-0 again, and held
		t.Fatalf("at 74h: archived %d, want 2", res.Archived)
	}

	var seen []string
	var after *ledger.RecordKey
	for {
		page, err := s.ListRecords(ctx, &ledger.ListParams{Tenant: "t", Archived: true, Limit: 1, After: after})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range page.Records {
			if r.ArchivedAt.IsZero() || r.Record.State != statemachine.StateUnknown || string(r.Record.Fingerprint) != "fp-"+r.Key {
				t.Fatalf("archived %s: %+v at %v", r.Key, r.Record, r.ArchivedAt)
			}
			if r.Key == "failed-unknown" && r.Record.FailureReason != "timeout talking to the bank" {
				t.Fatalf("failure reason lost: %q", r.Record.FailureReason)
			}
			seen = append(seen, r.Key)
			after = &r.RecordKey
		}
		if !page.More {
			break
		}
	}
	want := "[failed-unknown held lapsed-0 lapsed-0 lapsed-1 lapsed-2 lapsed-3 lapsed-4]"
	if fmt.Sprint(seen) != want {
		t.Fatalf("archive pages: %v, want %s", seen, want)
	}
	live, err := s.ListRecords(ctx, &ledger.ListParams{Tenant: "t", Limit: 100})
	// The completed record expired and was deleted, never archived.
	if err != nil || len(live.Records) != 0 {
		t.Fatalf("live records: %+v %v", live, err)
	}
}

// TestArchivePruning deletes archived records once they are older than the
// archive retention, counted from archived_at, in batches, and keeps the
// younger ones; a zero retention keeps the whole archive.
func TestArchivePruning(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	unknown := func(scope, k string) {
		t.Helper()
		res, err := s.Begin(ctx, &ledger.BeginParams{ID: ledger.Identity{Tenant: "t", Scope: scope, Key: k},
			Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Second}})
		if err != nil || res.Outcome != statemachine.OutcomeAcquired {
			t.Fatalf("Begin %s: %+v %v", k, res, err)
		}
	}
	reap := func(retention time.Duration) ledger.ReapResult {
		t.Helper()
		res, err := s.Reap(ctx, &ledger.ReapParams{BatchSize: 2, UnknownRetention: time.Hour, ArchiveRetention: retention})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	archived := func() []string {
		t.Helper()
		page, err := s.ListRecords(ctx, &ledger.ListParams{Tenant: "t", Archived: true, Limit: 100})
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, r := range page.Records {
			keys = append(keys, r.Key)
		}
		return keys
	}
	for i := range 3 {
		unknown("old", fmt.Sprintf("old-%d", i))
	}
	clock.Advance(2 * time.Hour)
	if res := reap(0); res.Archived != 3 {
		t.Fatalf("first archiving: %+v, want 3 archived", res)
	}
	unknown("young", "young-0")
	clock.Advance(2 * time.Hour)
	if res := reap(0); res.Archived != 1 || res.ArchivePruned != 0 {
		t.Fatalf("second archiving: %+v, want 1 archived and nothing pruned", res)
	}

	// Archived at 2h and at 4h; now 4h.
	clock.Advance(90 * time.Hour) // 94h
	if res := reap(0); res.ArchivePruned != 0 || len(archived()) != 4 {
		t.Fatalf("retention 0: %+v, archive %v; want all kept", res, archived())
	}
	if res := reap(93 * time.Hour); res.ArchivePruned != 0 {
		t.Fatalf("at 94h, retention 93h: %+v, want nothing pruned (the oldest were archived 92h ago)", res)
	}
	clock.Advance(time.Hour) // 95h: the old three were archived 93h ago, the young one 91h ago
	res := reap(92 * time.Hour)
	if res.ArchivePruned != 3 || fmt.Sprint(res.ArchivePrunedScopes) != "[old old old]" {
		t.Fatalf("at 95h, retention 92h: %+v, want the 3 old records pruned, in batches of 2", res)
	}
	if got := fmt.Sprint(archived()); got != "[young-0]" {
		t.Fatalf("archive after pruning: %s, want [young-0]", got)
	}
	if res := reap(92 * time.Hour); res.ArchivePruned != 0 {
		t.Fatalf("a second pass: %+v, want nothing more pruned", res)
	}
}
