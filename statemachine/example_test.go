package statemachine_test

import (
	"fmt"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// A key's life: the first Begin acquires it, the holder completes it, and a
// retry of the same request replays the stored response without a write.
func ExampleNext() {
	outcome := map[statemachine.Outcome]string{statemachine.OutcomeOK: "OK",
		statemachine.OutcomeAcquired: "ACQUIRED", statemachine.OutcomeReplay: "REPLAY",
		statemachine.OutcomeInProgress: "IN_PROGRESS"}
	write := map[statemachine.Write]string{statemachine.WriteNone: "none",
		statemachine.WriteInsert: "insert", statemachine.WriteUpdate: "update",
		statemachine.WriteDelete: "delete"}

	pol := statemachine.Policy{} // on_expired: restart, on_unknown: takeover
	now := time.Date(2030, 1, 2, 12, 0, 0, 0, time.UTC)
	begin := func(token string) statemachine.Event {
		return statemachine.Event{Kind: statemachine.EventBegin, Fingerprint: []byte("sha256:9f86d0"),
			NewToken: token, TTL: 24 * time.Hour, FailureTTL: time.Hour, Lease: 30 * time.Second}
	}

	// No record yet: the store passes nil.
	d := statemachine.Next(nil, begin("lt-1"), pol, now)
	fmt.Println("Begin:   ", outcome[d.Outcome], "write", write[d.Write], d.Record.State,
		"token", d.Record.LeaseToken, "lease until", d.Record.LeaseExpiresAt.Format(time.TimeOnly))
	rec := d.Record

	now = now.Add(2 * time.Second)
	d = statemachine.Next(&rec, statemachine.Event{Kind: statemachine.EventComplete, Token: "lt-1",
		Response: &statemachine.Response{SchemaVersion: "payments.v1.ChargeResponse/3", Body: []byte(`{"charge":"ch_1"}`)}},
		pol, now)
	fmt.Println("Complete:", outcome[d.Outcome], "write", write[d.Write], d.Record.State,
		"expires", d.Record.ExpiresAt.Format(time.DateTime))
	rec = d.Record

	now = now.Add(time.Minute)
	d = statemachine.Next(&rec, begin("lt-2"), pol, now)
	fmt.Println("Begin:   ", outcome[d.Outcome], "write", write[d.Write], d.Record.State,
		d.Record.Response.SchemaVersion, string(d.Record.Response.Body))

	// Output:
	// Begin:    ACQUIRED write insert IN_PROGRESS token lt-1 lease until 12:00:30
	// Complete: OK write update COMPLETED expires 2030-01-03 12:00:02
	// Begin:    REPLAY write none COMPLETED payments.v1.ChargeResponse/3 {"charge":"ch_1"}
}
