// Package payments is a demo of idemcoord's same-transaction mode
// (ledger.Store.RunTx) with a River outbox and an inbox consumer.
//
// POST /charges with an Idempotency-Key header creates a charge. In one
// PostgreSQL transaction the handler writes the charge row, enqueues a
// receipt job with River's InsertTx (the outbox) and stores the HTTP answer
// as the key's idempotency record, so the three commit together or not at
// all: a retry after a crash either replays the answer or runs the charge
// for the first time, never twice, and no key is ever left UNKNOWN.
//
// River delivers the receipt job at least once (a worker killed after its
// work and before River marks the job done runs it again). The receipt
// worker is an inbox: it runs its effect (a row in receipts_sent, standing
// for the e-mail) through RunTx keyed by the message id, so each message
// has its effect exactly once.
//
// cmd/paymentsd runs it; payments_test.go kills it with SIGKILL at random
// points under concurrent retries and checks the outcome.
package payments

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// Scopes of the demo's idempotency records.
const (
	// ChargeScope holds one record per Idempotency-Key of POST /charges.
	ChargeScope = "payments.charge"
	// ReceiptInboxScope holds one record per receipt message consumed.
	ReceiptInboxScope = "payments.receipt-inbox"
)

// schema is the demo's business tables. charges has no unique constraint
// on idempotency_key on purpose: the kill test counts rows to show that
// RunTx alone keeps one charge per key (a real service may add one as a
// second fence). receipts_sent likewise has none on charge_id, so a
// receipt processed twice would show.
const schema = `
CREATE TABLE IF NOT EXISTS charges (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL,
    customer        text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS receipts_sent (
    id         bigserial   PRIMARY KEY,
    charge_id  bigint      NOT NULL,
    message_id text        NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);`

// Migrate brings the database at databaseURL to the demo's schema:
// idemcoord's records (ledger.Migrate), River's tables and the business
// tables. It is safe to run again.
func Migrate(ctx context.Context, databaseURL string) error {
	if err := ledger.Migrate(ctx, databaseURL); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("river migrate: %w", err)
	}
	_, err = pool.Exec(ctx, schema)
	return err
}

// ReceiptArgs is the receipt job: the outbox message a charge emits.
type ReceiptArgs struct {
	// MessageID identifies the message for the consumer's inbox.
	MessageID   string `json:"message_id"`
	ChargeID    int64  `json:"charge_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// Kind is River's name for the job.
func (ReceiptArgs) Kind() string { return "payments_receipt" }

// ReceiptWorker consumes receipt jobs through an inbox.
type ReceiptWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	Store *ledger.Store
	// Pause, when set, is called inside the inbox transaction after the
	// effect is written (the kill test uses it to widen the window).
	Pause func()
}

// Work sends the receipt once per message: a redelivered message replays
// the inbox record and does nothing.
func (w *ReceiptWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	id := ledger.Identity{Scope: ReceiptInboxScope, Key: job.Args.MessageID}
	_, _, err := w.Store.RunTx(ctx, id, ledger.TxOptions{TTL: 30 * 24 * time.Hour}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO receipts_sent (charge_id, message_id) VALUES ($1, $2)`,
			job.Args.ChargeID, job.Args.MessageID); err != nil {
			return nil, err
		}
		if w.Pause != nil {
			w.Pause()
		}
		return &statemachine.Response{StatusCode: 200}, nil
	})
	return err
}

// Service is the payments HTTP service.
type Service struct {
	Store  *ledger.Store
	River  *river.Client[pgx.Tx]
	Logger *slog.Logger
	// Pause, when set, is called inside the charge transaction after the
	// charge and its job are written.
	Pause func()
}

// ChargeRequest is the body of POST /charges.
type ChargeRequest struct {
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// Charge is the answer of POST /charges.
type Charge struct {
	ID          int64  `json:"id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
	ReceiptJob  int64  `json:"receipt_job"`
}

// ServeHTTP serves POST /charges and GET /healthz.
func (s *Service) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/healthz":
		if err := s.Store.Ping(r.Context()); err != nil {
			http.Error(w, "database unreachable", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	case r.URL.Path == "/charges" && r.Method == http.MethodPost:
		s.charge(w, r)
	default:
		http.NotFound(w, r)
	}
}

func (s *Service) charge(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
	if err != nil {
		http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
		return
	}
	var req ChargeRequest
	if key == "" || json.Unmarshal(body, &req) != nil || req.Customer == "" {
		http.Error(w, "want an Idempotency-Key header and a JSON body {customer, amount_cents}", http.StatusBadRequest)
		return
	}
	// The fingerprint binds the key to this exact request.
	fp := sha256.Sum256(append([]byte("POST /charges\n"), body...))

	id := ledger.Identity{Scope: ChargeScope, Key: key}
	resp, replayed, err := s.Store.RunTx(r.Context(), id, ledger.TxOptions{Fingerprint: fp[:]}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if req.AmountCents <= 0 {
			// A business rejection: stored and replayed like a success.
			return nil, &ledger.ReplayableError{Response: &statemachine.Response{StatusCode: http.StatusUnprocessableEntity,
				ContentType: "text/plain; charset=utf-8", Body: []byte("amount_cents must be positive\n")}}
		}
		c := Charge{Customer: req.Customer, AmountCents: req.AmountCents}
		if err := tx.QueryRow(ctx, `INSERT INTO charges (idempotency_key, customer, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			key, req.Customer, req.AmountCents).Scan(&c.ID); err != nil {
			return nil, err
		}
		// The outbox: the receipt job commits with the charge.
		job, err := s.River.InsertTx(ctx, tx, ReceiptArgs{MessageID: "receipt:" + key, ChargeID: c.ID,
			Customer: c.Customer, AmountCents: c.AmountCents}, nil)
		if err != nil {
			return nil, err
		}
		c.ReceiptJob = job.Job.ID
		if s.Pause != nil {
			s.Pause()
		}
		out, err := json.Marshal(c)
		if err != nil {
			return nil, err
		}
		return &statemachine.Response{StatusCode: http.StatusCreated, ContentType: "application/json", Body: append(out, '\n')}, nil
	})
	var rejected *ledger.ReplayableError
	switch {
	case errors.As(err, &rejected):
	case errors.Is(err, ledger.ErrInProgress):
		w.Header().Set("Retry-After", "1")
		http.Error(w, "a request with this key is in progress", http.StatusConflict)
		return
	case errors.Is(err, statemachine.ErrFingerprintMismatch):
		http.Error(w, "this Idempotency-Key was used with another request", http.StatusUnprocessableEntity)
		return
	case errors.Is(err, ledger.ErrInvalidArgument):
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	case err != nil:
		s.Logger.Error("charge failed", "err", err)
		http.Error(w, "temporarily unavailable", http.StatusServiceUnavailable)
		return
	}
	result := "created"
	if replayed {
		result = "replayed"
	}
	w.Header().Set("Idempotency-Result", result)
	if resp.ContentType != "" {
		w.Header().Set("Content-Type", resp.ContentType)
	}
	w.WriteHeader(int(resp.StatusCode))
	_, _ = w.Write(resp.Body)
}

// RiverConfig returns the River configuration of the demo's worker side:
// the receipt worker, and stuck jobs (their worker killed) rescued after
// rescueAfter and retried after a short fixed delay.
func RiverConfig(store *ledger.Store, rescueAfter time.Duration, pause func(), logger *slog.Logger) *river.Config {
	workers := river.NewWorkers()
	river.AddWorker(workers, &ReceiptWorker{Store: store, Pause: pause})
	return &river.Config{
		Queues:               map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 8}},
		Workers:              workers,
		JobTimeout:           rescueAfter / 2,
		RescueStuckJobsAfter: rescueAfter,
		RetryPolicy:          fixedRetry{},
		Logger:               logger,
	}
}

// fixedRetry retries a job after a short delay, whatever its attempt.
type fixedRetry struct{}

func (fixedRetry) NextRetry(*rivertype.JobRow) time.Time {
	return time.Now().Add(200*time.Millisecond + rand.N(300*time.Millisecond)) //nolint:gosec // jitter of a retry time, not a secret
}
