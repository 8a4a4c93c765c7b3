package console_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemcoord/idemcoord/console"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// chromium finds a Chromium (Debian's package installs /usr/bin/chromium;
// IDEMCOORD_CHROMIUM names another). Without one the browser test is
// skipped, except under CI=true, where it fails: .ci/run installs it.
func chromium(t *testing.T) string {
	t.Helper()
	candidates := []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"}
	if p := os.Getenv("IDEMCOORD_CHROMIUM"); p != "" {
		candidates = []string{p}
	}
	for _, c := range candidates {
		if p, err := exec.LookPath(c); err == nil {
			return p
		}
	}
	msg := "no Chromium found (looked for " + strings.Join(candidates, ", ") + "): install Debian's chromium package " +
		"(apt-get install chromium, as .ci/run does) or set IDEMCOORD_CHROMIUM to run the browser test"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// newBrowser starts a headless Chromium with a fresh profile and returns a
// context for one tab.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	exe := chromium(t)
	alloc, cancel := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(exe),
		chromedp.Headless,
		chromedp.NoSandbox, // as root in a container, Chromium's sandbox cannot start
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1100, 900),
	)
	t.Cleanup(cancel)
	ctx, cancelTab := chromedp.NewContext(alloc, chromedp.WithErrorf(t.Logf))
	t.Cleanup(cancelTab)
	// Start the browser without a deadline: a deadline here would end it.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start %s: %v", exe, err)
	}
	return ctx
}

// step runs browser actions with a generous limit, failing the test with
// what it was doing.
func step(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}

func screenshot(t *testing.T, ctx context.Context, path string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(png))
}

// TestBrowserResolvesUnknown drives the console in headless Chromium: sign
// in, find the UNKNOWN record the test made, resolve it as completed with a
// pasted body, and see it COMPLETED. The record page's screenshot is saved
// in the test's artifact directory (go test -artifacts keeps it).
//
// With IDEMCOORD_CONSOLE_SCREENSHOTS=DIR (make console-screenshot) it also
// writes the README's pictures, console-dashboard.png and
// console-record.png, into DIR.
func TestBrowserResolvesUnknown(t *testing.T) {
	ctx := newBrowser(t)
	e := newConsoleEnv(t, false)
	docs := os.Getenv("IDEMCOORD_CONSOLE_SCREENSHOTS")
	if docs != "" {
		fillForScreenshots(t, e)
	}
	key := "u1:7c1e5a0e-order-1042"
	e.unknownRecord(opsToken, chargeScope, key)

	// Any page sends a browser without a session to the login form.
	step(t, ctx, "open the console", chromedp.Navigate(e.http.URL+"/console/"), chromedp.WaitVisible(chromedp.ID("token")))
	step(t, ctx, "sign in",
		chromedp.SendKeys(chromedp.ID("token"), opsToken),
		chromedp.Click(chromedp.ID("signin")),
		chromedp.WaitVisible(chromedp.ID("tenant")))
	if got := text(t, ctx, "#tenant"); got != "ops" {
		t.Fatalf("signed in as %q", got)
	}
	if docs != "" {
		screenshot(t, ctx, filepath.Join(docs, "console-dashboard.png"))
	} else if got := text(t, ctx, "#chart-collecting"); !strings.HasPrefix(got, "Collecting:") {
		// No counter samples yet: the chart says so, visibly.
		t.Fatalf("activity chart before any samples: %q", got)
	}
	step(t, ctx, "list the records that need a decision",
		chromedp.Click(chromedp.CSS(`nav a[href="/console/records?uncertain=1"]`)),
		chromedp.WaitVisible(chromedp.ID("records")))
	if list := text(t, ctx, "#records"); !strings.Contains(list, key) || !strings.Contains(list, chargeScope) {
		t.Fatalf("the decision list does not show %s: %s", key, list)
	}
	step(t, ctx, "open the record",
		chromedp.Click(chromedp.Search(`//table[@id="records"]//a[normalize-space(.)="`+key+`"]`)),
		chromedp.WaitVisible(chromedp.ID("state")))
	if got := text(t, ctx, "#state"); got != "unknown" {
		t.Fatalf("record state %q, want unknown", got)
	}
	if got := text(t, ctx, "#scope"); got != chargeScope {
		t.Fatalf("record scope %q", got)
	}
	step(t, ctx, "ask to resolve as completed",
		chromedp.Click(chromedp.ID("resolve-completed")),
		chromedp.WaitVisible(chromedp.ID("confirm")))
	if got := text(t, ctx, "#confirm"); got != "Resolve "+key+" as completed" {
		t.Fatalf("confirmation button says %q", got)
	}
	body := `{"charge_id": "ch_3PzK9", "amount": 4200, "currency": "eur"}`
	step(t, ctx, "paste the body and confirm",
		chromedp.SendKeys(chromedp.ID("body"), body),
		chromedp.SetValue(chromedp.ID("schema_version"), "payments.v1.ChargeResponse"),
		chromedp.SetValue(chromedp.ID("content_type"), "application/json"),
		chromedp.SetValue(chromedp.ID("status_code"), "0"),
		chromedp.SendKeys(chromedp.ID("metadata"), "x-charge-id: ch_3PzK9\nx-reconciled-by: ops"),
		chromedp.Click(chromedp.ID("confirm")),
		chromedp.WaitVisible(chromedp.CSS(".flash")))
	if got := text(t, ctx, "#state"); got != "completed" {
		t.Fatalf("record state after resolving: %q, want completed", got)
	}
	if got := text(t, ctx, "#body"); got != body {
		t.Fatalf("stored body shown as %q", got)
	}
	if got := text(t, ctx, "#metadata"); !strings.Contains(got, "x-reconciled-by") {
		t.Fatalf("metadata table: %q", got)
	}
	screenshot(t, ctx, filepath.Join(t.ArtifactDir(), "record.png"))
	if docs != "" {
		screenshot(t, ctx, filepath.Join(docs, "console-record.png"))
	}

	rec, err := e.lookup(opsToken, chargeScope, key)
	if err != nil || rec.GetState() != idempotencyv1.State_STATE_COMPLETED || string(rec.GetResponse().GetBody()) != body ||
		rec.GetResponse().GetMetadata()["x-charge-id"] != "ch_3PzK9" {
		t.Fatalf("record in the coordinator: %v %v", rec, err)
	}
	if !strings.Contains(e.log.String(), `msg="console: record resolved" tenant=ops`) {
		t.Fatalf("no action log line:\n%s", e.log.String())
	}
}

// fillForScreenshots gives the README's pictures something to show: a
// few scopes in several states, and an hour of counter samples taken
// between rounds of traffic.
func fillForScreenshots(t *testing.T, e *consoleEnv) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+opsToken)
	start := time.Now().Add(-time.Hour)
	n := 0
	begin := func(scope string, lease time.Duration) *idempotencyv1.BeginResponse {
		n++
		r, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: fmt.Sprintf("req-%04d", n),
			Lease: durationpb.New(lease)})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	for i := range 61 {
		for j := range 3 + (i*7)%11 {
			r := begin("/payments.v1.Payments/Charge", time.Hour)
			if j%5 != 4 {
				if _, err := e.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "/payments.v1.Payments/Charge",
					Key: r.GetRecord().GetKey(), LeaseToken: r.GetLeaseToken()}); err != nil {
					t.Fatal(err)
				}
				// A retry of the same key replays.
				if _, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "/payments.v1.Payments/Charge", Key: r.GetRecord().GetKey()}); err != nil {
					t.Fatal(err)
				}
			} else if i%4 == 0 {
				if _, err := e.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "/payments.v1.Payments/Charge",
					Key: r.GetRecord().GetKey(), LeaseToken: r.GetLeaseToken(), Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN}); err != nil {
					t.Fatal(err)
				}
			}
		}
		if i%3 == 0 {
			begin("build", time.Hour)
		}
		console.SampleAt(e.console, start.Add(time.Duration(i)*time.Minute))
	}
}
