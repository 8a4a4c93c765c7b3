package ledger_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// A holder of a key (here through the Store; a handler under the clients
// interceptor has the same lease from clients.LeaseFrom) runs a
// multi-step operation whose rows live in the coordinator's database: each
// step's rows and the checkpoint that says the step is done commit in one
// transaction, so a crash leaves both or neither, and the next attempt
// resumes after the last committed step.
func ExampleStore_CheckpointTx() {
	ctx := context.Background()
	databaseURL, done := exampleDatabase("ExampleStore_CheckpointTx")
	defer done()
	store, err := ledger.Open(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close(ctx)

	id := ledger.Identity{Scope: "POST /orders", Key: "order-8"}
	res, err := store.Begin(ctx, &ledger.BeginParams{ID: id,
		Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Step "charged": the charge row and the checkpoint, together.
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		var charge int64
		if err := tx.QueryRow(ctx, `INSERT INTO charges (customer, amount_cents) VALUES ('ada', 1250) RETURNING id`).Scan(&charge); err != nil {
			return err
		}
		_, err := store.CheckpointTx(ctx, tx, &ledger.CheckpointParams{ID: id, Token: res.Record.LeaseToken,
			Phase: "charged", Data: fmt.Appendf(nil, "%d", charge)})
		return err // an error rolls back the charge and the checkpoint
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	rec, _, err := store.Lookup(ctx, id)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(rec.State, rec.Checkpoint.Phase, string(rec.Checkpoint.Data))
	// Output:
	// IN_PROGRESS charged 1
}
