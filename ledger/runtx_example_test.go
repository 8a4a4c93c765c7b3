package ledger_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// A payments service keeps its idempotency records in its own database, so
// the charge and the record of the request that made it commit together. A
// retry of the request replays the answer; the charge is made once.
func ExampleStore_RunTx() {
	ctx := context.Background()
	databaseURL, done := exampleDatabase("ExampleStore_RunTx") // the service's own database
	defer done()

	// At start-up: the same migrations the coordinator applies.
	if err := ledger.Migrate(ctx, databaseURL); err != nil {
		fmt.Println(err)
		return
	}
	store, err := ledger.Open(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	charge := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO charges (customer, amount_cents) VALUES ('ada', 1250) RETURNING id`).Scan(&id); err != nil {
			return nil, err // rolls back: no charge, no record; the key may run again
		}
		return &statemachine.Response{StatusCode: 201, ContentType: "application/json",
			Body: fmt.Appendf(nil, `{"charge":%d}`, id)}, nil
	}
	// The Idempotency-Key of the request, and a hash of its body.
	id := ledger.Identity{Scope: "POST /charges", Key: "order-7"}
	opts := ledger.TxOptions{Fingerprint: []byte("sha256 of the request body")}
	for range 2 { // the request, then a retry of it
		resp, replayed, err := store.RunTx(ctx, id, opts, charge)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(resp.StatusCode, string(resp.Body), "replayed:", replayed)
	}
	// Output:
	// 201 {"charge":1} replayed: false
	// 201 {"charge":1} replayed: true
}

// An inbox: a consumer that receives each message at least once runs its
// effect exactly once by keying RunTx with the message id. A redelivered
// message replays and changes nothing.
func ExampleStore_RunTx_inbox() {
	ctx := context.Background()
	databaseURL, done := exampleDatabase("ExampleStore_RunTx_inbox")
	defer done()
	store, err := ledger.Open(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	deliveries := []string{"msg-1", "msg-2", "msg-1"} // msg-1 is delivered twice
	for _, msgID := range deliveries {
		_, duplicate, err := store.RunTx(ctx, ledger.Identity{Scope: "receipts-consumer", Key: msgID},
			ledger.TxOptions{TTL: 7 * 24 * time.Hour}, // longer than the sender may redeliver
			func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
				_, err := tx.Exec(ctx, `INSERT INTO receipts_sent (message_id) VALUES ($1)`, msgID)
				return nil, err
			})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(msgID, "duplicate:", duplicate)
	}
	// Output:
	// msg-1 duplicate: false
	// msg-2 duplicate: false
	// msg-1 duplicate: true
}

// receiptArgs is the job of the River outbox example.
type receiptArgs struct {
	ChargeID int64 `json:"charge_id"`
}

func (receiptArgs) Kind() string { return "receipt" }

// An outbox on River: the follow-up job is inserted with InsertTx inside
// fn, so it exists exactly when the charge and its record committed. River
// delivers it with retries; its worker dedupes with an inbox keyed by the
// job's message.
func ExampleStore_RunTx_riverOutbox() {
	ctx := context.Background()
	databaseURL, done := exampleDatabase("ExampleStore_RunTx_riverOutbox")
	defer done()
	store, err := ledger.Open(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil { // River's tables
		fmt.Println(err)
		return
	}

	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[receiptArgs]) error {
		msgID := fmt.Sprintf("receipt-%d", job.Args.ChargeID)
		_, duplicate, err := store.RunTx(ctx, ledger.Identity{Scope: "receipts-consumer", Key: msgID}, ledger.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
				_, err := tx.Exec(ctx, `INSERT INTO receipts_sent (message_id) VALUES ($1)`, msgID)
				return nil, err
			})
		if err == nil && !duplicate {
			fmt.Println("receipt sent for charge", job.Args.ChargeID)
		}
		return err
	}))
	riverClient, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}},
		Workers: workers,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	completed, stopWatching := riverClient.Subscribe(river.EventKindJobCompleted)
	defer stopWatching()
	if err := riverClient.Start(ctx); err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = riverClient.Stop(ctx) }()

	resp, _, err := store.RunTx(ctx, ledger.Identity{Scope: "POST /charges", Key: "order-8"}, ledger.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO charges (customer, amount_cents) VALUES ('ada', 990) RETURNING id`).Scan(&id); err != nil {
				return nil, err
			}
			// The outbox: committed with the charge, or not at all.
			if _, err := riverClient.InsertTx(ctx, tx, receiptArgs{ChargeID: id}, nil); err != nil {
				return nil, err
			}
			return &statemachine.Response{StatusCode: 201, Body: fmt.Appendf(nil, `{"charge":%d}`, id)}, nil
		})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(resp.StatusCode, string(resp.Body))
	select {
	case <-completed:
	case <-time.After(time.Minute):
		fmt.Println("the receipt job did not complete")
	}
	// Output:
	// 201 {"charge":1}
	// receipt sent for charge 1
}

// exampleDatabase returns a migrated database with the examples' business
// tables, and a function that drops it.
func exampleDatabase(name string) (string, func()) {
	t := &exampleT{name: name}
	url := pgtest.NewDatabase(t)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		panic(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), `
		CREATE TABLE charges (id bigserial PRIMARY KEY, customer text NOT NULL, amount_cents bigint NOT NULL);
		CREATE TABLE receipts_sent (message_id text NOT NULL, sent_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		panic(err)
	}
	return url, t.close
}

// exampleT is the part of testing.TB that pgtest uses; the embedded (nil)
// TB only satisfies the interface, and calling any other method panics,
// which fails the example loudly.
type exampleT struct {
	testing.TB
	name     string
	failed   bool
	cleanups []func()
}

func (e *exampleT) Helper()             {}
func (e *exampleT) Name() string        { return e.name }
func (e *exampleT) Failed() bool        { return e.failed }
func (e *exampleT) Logf(string, ...any) {}
func (e *exampleT) Cleanup(f func())    { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) Fatal(args ...any)   { panic(fmt.Sprint(args...)) }
func (e *exampleT) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (e *exampleT) Errorf(format string, args ...any) {
	e.failed = true
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}

// close runs the cleanups, last registered first.
func (e *exampleT) close() {
	for _, v := range slices.Backward(e.cleanups) {
		v()
	}
}
