package main

import (
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// maxBodyShown is the longest body the table output shows as text.
const maxBodyShown = 256

// printJSON writes m as indented protojson and a newline.
func (c *cli) printJSON(m proto.Message) error {
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(m)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(c.stdout, "%s\n", b)
	return err
}

// printRecord shows one record: in JSON as the Record message, in a table
// as one field a line.
func (c *cli) printRecord(r *idempotencyv1.Record) error {
	if c.output == "json" {
		return c.printJSON(r)
	}
	w := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	row := func(name, value string) { fmt.Fprintf(w, "%s\t%s\n", name, value) }
	row("scope", terminalText(r.GetScope()))
	row("key", terminalText(r.GetKey()))
	row("state", stateName(r.GetState()))
	row("attempt", strconv.Itoa(int(r.GetAttempt())))
	row("generation", strconv.Itoa(int(r.GetGeneration())))
	row("fingerprint", orDash(hex.EncodeToString(r.GetFingerprint())))
	row("created", timeText(r.GetCreatedAt()))
	row("updated", timeText(r.GetUpdatedAt()))
	row("lease expires", timeText(r.GetLeaseExpiresAt()))
	row("expires", timeText(r.GetExpiresAt()))
	row("failure reason", orDash(terminalText(r.GetFailureReason())))
	if resp := r.GetResponse(); resp != nil {
		row("schema version", orDash(terminalText(resp.GetSchemaVersion())))
		row("content type", orDash(terminalText(resp.GetContentType())))
		row("status code", strconv.Itoa(int(resp.GetStatusCode())))
		for _, k := range slices.Sorted(maps.Keys(resp.GetMetadata())) {
			row("metadata "+terminalText(k), terminalText(resp.GetMetadata()[k]))
		}
		row("body", bodyText(resp.GetBody()))
	} else {
		row("response", "-")
	}
	if cp := r.GetCheckpoint(); cp != nil {
		row("checkpoint", terminalText(cp.GetPhase()))
		row("checkpoint data", checkpointDataText(cp.GetData()))
		row("checkpoint at", timeText(cp.GetAt()))
	} else {
		row("checkpoint", "-")
	}
	return w.Flush()
}

// checkpointDataText shows a checkpoint's data safely on a terminal: its
// size, then the data quoted (Go syntax, escapes for anything unprintable)
// when it is valid UTF-8, else in base64.
func checkpointDataText(b []byte) string {
	text := fmt.Sprintf("%d bytes", len(b))
	switch {
	case len(b) == 0:
		return text
	case utf8.Valid(b):
		return text + ": " + strconv.Quote(string(b))
	}
	return text + ", base64: " + base64.StdEncoding.EncodeToString(b)
}

// printList shows records: in JSON as a ListRecordsResponse (whose
// next_page_token is set when --limit cut the listing short), in a table
// as one record a line.
func (c *cli) printList(l *idempotencyv1.ListRecordsResponse) error {
	if c.output == "json" {
		return c.printJSON(l)
	}
	w := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	// Archived records (listed with --archived) get a column of their own.
	archived := len(l.GetRecords()) > 0 && l.GetRecords()[0].GetArchivedAt() != nil
	header := "SCOPE\tKEY\tSTATE\tATTEMPT\tGENERATION\tUPDATED\tLEASE EXPIRES\tEXPIRES"
	if archived {
		header += "\tARCHIVED"
	}
	fmt.Fprintln(w, header)
	for _, r := range l.GetRecords() {
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s", terminalText(r.GetScope()), terminalText(r.GetKey()), stateName(r.GetState()),
			r.GetAttempt(), r.GetGeneration(), timeText(r.GetUpdatedAt()), timeText(r.GetLeaseExpiresAt()),
			timeText(r.GetExpiresAt()))
		if archived {
			fmt.Fprintf(w, "\t%s", timeText(r.GetArchivedAt()))
		}
		fmt.Fprintln(w)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if l.GetNextPageToken() != "" {
		_, err := fmt.Fprintf(c.stdout, "(more records follow: raise --limit, or --limit 0 for all)\n")
		return err
	}
	return nil
}

func timeText(t *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	return t.AsTime().UTC().Format(time.RFC3339Nano)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// terminalText shows s as it is when it is valid UTF-8 and every character
// is printable (or a space), else quoted in Go syntax: no control, format
// or bidirectional-override character of a record reaches the terminal,
// whatever wrote it (a phase or key may hold U+202E, a failure reason ESC).
func terminalText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) && r != ' ' }) {
		return s
	}
	return strconv.Quote(s)
}

// bodyText shows a body's size, and the body itself when it is short
// printable text.
func bodyText(b []byte) string {
	text := fmt.Sprintf("%d bytes", len(b))
	if len(b) == 0 || len(b) > maxBodyShown || !utf8.Valid(b) {
		return text
	}
	if strings.ContainsFunc(string(b), func(r rune) bool { return !unicode.IsPrint(r) && r != ' ' }) {
		return text
	}
	return text + ": " + string(b)
}
