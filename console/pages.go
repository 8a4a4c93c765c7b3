package console

import (
	"encoding/hex"
	"fmt"
	"html/template"
	"io"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// pageNames are the page templates; each is parsed with layout.html.
var pageNames = []string{"dashboard", "login", "records", "record", "confirm", "error"}

var funcs = template.FuncMap{
	"stateName": stateName,
	"recordURL": recordURL,
	"confirmURL": func(action, scope, key string) template.URL {
		return template.URL("/console/confirm?" + url.Values{"action": {action}, "scope": {scope}, "key": {key}}.Encode()) //nolint:gosec // a fixed path and a query that url.Values.Encode escapes
	},
	"listURL": func(state, scope string) template.URL {
		return listURL(listFilter{State: state, Scope: scope}, "")
	},
	"every": func(d time.Duration) string {
		if d == time.Minute {
			return "minute"
		}
		return d.String()
	},
	"time": func(ts *timestamppb.Timestamp) string {
		if ts == nil {
			return "—"
		}
		return ts.AsTime().UTC().Format("2006-01-02 15:04:05.000 MST")
	},
	"hex": func(b []byte) string {
		if len(b) == 0 {
			return "—"
		}
		return hex.EncodeToString(b)
	},
}

func parsePages() map[string]*template.Template {
	pages := make(map[string]*template.Template, len(pageNames))
	for _, name := range pageNames {
		pages[name] = template.Must(template.New(name).Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/"+name+".html"))
	}
	return pages
}

// stateName is a state as idemctl writes it: lower case, no prefix.
func stateName(s idempotencyv1.State) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STATE_"))
}

// parseState reads a state written as stateName does (any case); empty is
// STATE_UNSPECIFIED (every state).
func parseState(s string) (idempotencyv1.State, bool) {
	if s == "" {
		return idempotencyv1.State_STATE_UNSPECIFIED, true
	}
	v, ok := idempotencyv1.State_value["STATE_"+strings.ToUpper(s)]
	if !ok || v == 0 {
		return 0, false
	}
	return idempotencyv1.State(v), true
}

// allStates are the states a record can be in, in the order pages list
// them.
var allStates = []idempotencyv1.State{
	idempotencyv1.State_STATE_UNKNOWN, idempotencyv1.State_STATE_IN_PROGRESS, idempotencyv1.State_STATE_COMPLETED,
	idempotencyv1.State_STATE_FAILED_RETRYABLE, idempotencyv1.State_STATE_FAILED_REPLAYABLE, idempotencyv1.State_STATE_EXPIRED,
}

// recordURL is the record page of (scope, key); both go in the query, so
// slashes and every other byte survive.
func recordURL(scope, key string) template.URL {
	return template.URL("/console/record?" + url.Values{"scope": {scope}, "key": {key}}.Encode()) //nolint:gosec // a fixed path and a query that url.Values.Encode escapes
}

// listFilter are the record list's filters, as in its URL.
type listFilter struct {
	State, Scope, Prefix string
	// Uncertain keeps only the records that need a decision (UNKNOWN, and
	// uncertain FAILED_RETRYABLE): ListRecordsRequest.uncertain. In the
	// URL it is uncertain=1.
	Uncertain bool
}

func listURL(f listFilter, page string) template.URL {
	q := url.Values{}
	uncertain := ""
	if f.Uncertain {
		uncertain = "1"
	}
	for k, v := range map[string]string{"state": f.State, "scope": f.Scope, "prefix": f.Prefix, "uncertain": uncertain, "page": page} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if len(q) == 0 {
		return "/console/records"
	}
	return template.URL("/console/records?" + q.Encode()) //nolint:gosec // a fixed path and a query that url.Values.Encode escapes
}

// flashes are the messages a redirect after an action may ask a page to
// show; only these fixed texts are ever shown.
var flashes = map[string]string{
	"completed": "Resolved as completed: later Begins replay the stored response.",
	"retryable": "Resolved as retryable: the next Begin runs the operation again.",
	"forgotten": "Forgotten: the next Begin of that key starts afresh.",
	"signedin":  "Signed in.",
}

// dashboardPage is the dashboard's data.
type dashboardPage struct {
	States    []stateCount
	Scopes    []scopeRow
	AllStates []idempotencyv1.State
	Truncated bool
	Chart     *chart
}

type stateCount struct {
	State idempotencyv1.State
	Count int64
}

type scopeRow struct {
	Scope  string
	Counts []int64 // in allStates order
	Total  int64
}

func (c *Console) dashboard(w http.ResponseWriter, r *http.Request) {
	var md metadata.MD
	resp, err := c.admin.CountRecords(callContext(r), &idempotencyv1.CountRecordsRequest{}, grpc.Header(&md))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	p := &dashboardPage{AllStates: allStates, Truncated: resp.GetTruncated()}
	byState := map[idempotencyv1.State]int64{}
	for _, rc := range resp.GetCounts() {
		byState[rc.GetState()] += rc.GetCount()
		if n := len(p.Scopes); n == 0 || p.Scopes[n-1].Scope != rc.GetScope() {
			p.Scopes = append(p.Scopes, scopeRow{Scope: rc.GetScope(), Counts: make([]int64, len(allStates))})
		}
		row := &p.Scopes[len(p.Scopes)-1]
		if i := slices.Index(allStates, rc.GetState()); i >= 0 {
			row.Counts[i] += rc.GetCount()
		}
		row.Total += rc.GetCount()
	}
	for _, st := range allStates {
		p.States = append(p.States, stateCount{State: st, Count: byState[st]})
	}
	if c.opts.counters != nil {
		p.Chart = c.ring.chart(c.opts.sampleEvery)
	}
	c.render(w, r, http.StatusOK, "dashboard", view{Title: "Overview", Tenant: tenantOf(md), Flash: flashes[r.URL.Query().Get("done")], Page: p})
}

// loginPage is the login form's data.
type loginPage struct {
	Next  string
	Error string
}

func (c *Console) loginForm(w http.ResponseWriter, r *http.Request) {
	c.render(w, r, http.StatusOK, "login", view{Title: "Sign in", Page: loginPage{Next: safeNext(r.URL.Query().Get("next"))}})
}

// safeNext returns next when it is a console page of this server, else the
// dashboard. next must be a path under Prefix (other than the sign-in page)
// that is already clean once percent-decoded: no dot segments (a browser
// resolves "/console/../metrics", or its %2e%2e form, to "/metrics"), no
// empty segments, no backslash (some browsers read one as a slash, so
// "/console/..\evil.example" could leave the site), no control characters,
// and neither a scheme nor a host.
func safeNext(next string) string {
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || u.Opaque != "" ||
		!strings.HasPrefix(next, Prefix) || strings.ContainsFunc(next, unsafeInNext) || strings.ContainsFunc(u.Path, unsafeInNext) {
		return Prefix
	}
	clean := path.Clean(u.Path)
	if strings.HasSuffix(u.Path, "/") && clean != "/" {
		clean += "/"
	}
	if clean != u.Path || !strings.HasPrefix(clean, Prefix) || strings.HasPrefix(clean, "/console/login") {
		return Prefix
	}
	return next
}

// unsafeInNext reports whether r has no place in a sign-in redirect's
// target: a backslash or a control character.
func unsafeInNext(r rune) bool { return r == '\\' || r < 0x20 || r == 0x7f }

func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if !c.parsePost(w, r) {
		return
	}
	next := safeNext(r.PostFormValue("next"))
	token := strings.TrimSpace(r.PostFormValue("token"))
	if !validToken(token) {
		c.render(w, r, http.StatusUnauthorized, "login", view{Title: "Sign in", Page: loginPage{Next: next,
			Error: "Enter the bearer token of a tenant with admin: true (visible ASCII, at most 4096 bytes)."}})
		return
	}
	ctx := metadata.AppendToOutgoingContext(r.Context(), "authorization", "Bearer "+token)
	var md metadata.MD
	_, err := c.admin.ListRecords(ctx, &idempotencyv1.ListRecordsRequest{PageSize: 1}, grpc.Header(&md))
	if err != nil {
		code, msg := http.StatusBadGateway, "The coordinator could not check the token."
		switch status := statusCode(err); status {
		case "Unauthenticated":
			code, msg = http.StatusUnauthorized, "That token names no tenant."
		case "PermissionDenied":
			code, msg = http.StatusForbidden, "That tenant may not use the Admin API (it needs admin: true)."
		}
		c.opts.logger.Warn("console: sign-in refused", "remote", r.RemoteAddr, "code", statusCode(err))
		c.render(w, r, code, "login", view{Title: "Sign in", Page: loginPage{Next: next, Error: msg}})
		return
	}
	if err := c.startSession(w, r, tenantOf(md), token); err != nil {
		c.opts.logger.Error("console: cannot start a session", "tenant", tenantOf(md), "remote", r.RemoteAddr, "err", err)
		msg := "The token is valid, but the console cannot start a session now; try again shortly."
		if c.opts.sessions == nil {
			msg = "This console keeps no sessions, so it cannot sign in with a token; use a client certificate."
		}
		c.render(w, r, http.StatusServiceUnavailable, "login", view{Title: "Sign in", Page: loginPage{Next: next, Error: msg}})
		return
	}
	c.opts.logger.Info("console: signed in", "tenant", tenantOf(md), "remote", r.RemoteAddr)
	http.Redirect(w, r, next, http.StatusSeeOther) //nolint:gosec // safeNext admits only console paths of this server
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	if !c.parsePost(w, r) {
		return
	}
	if err := c.endSession(w, r); err != nil {
		c.opts.logger.Error("console: sign-out failed", "remote", r.RemoteAddr, "err", err)
		c.renderError(w, r, http.StatusServiceUnavailable, "Sign-out failed: the session may stay valid until it expires. Try again.")
		return
	}
	if s, ok := sessionOf(r); ok {
		c.opts.logger.Info("console: signed out", "tenant", s.tenant, "remote", r.RemoteAddr)
	}
	http.Redirect(w, r, "/console/login", http.StatusSeeOther)
}

// recordsPage is the record list's data.
type recordsPage struct {
	Filter    listFilter
	Records   []*idempotencyv1.Record
	Next      template.URL
	First     template.URL
	Paged     bool
	AllStates []idempotencyv1.State
}

// listPageSize is how many records one list page shows.
const listPageSize = 50

func (c *Console) records(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := listFilter{State: strings.ToLower(q.Get("state")), Scope: q.Get("scope"), Prefix: q.Get("prefix")}
	st, ok := parseState(f.State)
	if !ok {
		c.renderError(w, r, http.StatusBadRequest, fmt.Sprintf("Unknown state %q.", f.State))
		return
	}
	switch q.Get("uncertain") {
	case "", "0":
	case "1":
		f.Uncertain = true
	default:
		c.renderError(w, r, http.StatusBadRequest, "uncertain is 1 (only the records that need a decision) or absent.")
		return
	}
	var md metadata.MD
	resp, err := c.admin.ListRecords(callContext(r), &idempotencyv1.ListRecordsRequest{State: st, ScopeGlob: f.Scope,
		KeyPrefix: f.Prefix, Uncertain: f.Uncertain, PageSize: listPageSize, PageToken: q.Get("page")}, grpc.Header(&md))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	p := &recordsPage{Filter: f, Records: resp.GetRecords(), First: listURL(f, ""), Paged: q.Get("page") != "", AllStates: allStates}
	if resp.GetNextPageToken() != "" {
		p.Next = listURL(f, resp.GetNextPageToken())
	}
	title := "Records"
	if f.Uncertain {
		title = "Records that need a decision"
	}
	c.render(w, r, http.StatusOK, "records", view{Title: title, Tenant: tenantOf(md), Flash: flashes[q.Get("done")], Page: p})
}

// recordPage is the record page's data.
type recordPage struct {
	Record    *idempotencyv1.Record
	Unknown   bool // needs a decision: UNKNOWN, or an uncertain FAILED_RETRYABLE
	BodyText  string
	BodyHex   string
	BodyBytes int
	Metadata  [][2]string
	// The checkpoint's data, as the body: text when UTF-8, else a hex
	// dump.
	CheckpointText string
	CheckpointHex  string
}

func (c *Console) record(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var md metadata.MD
	resp, err := c.admin.GetRecord(callContext(r), &idempotencyv1.GetRecordRequest{Scope: q.Get("scope"), Key: q.Get("key")}, grpc.Header(&md))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	rec := resp.GetRecord()
	p := &recordPage{Record: rec, Unknown: rec.GetState() == idempotencyv1.State_STATE_UNKNOWN ||
		rec.GetState() == idempotencyv1.State_STATE_FAILED_RETRYABLE && rec.GetUncertain()}
	if res := rec.GetResponse(); res != nil {
		body := res.GetBody()
		p.BodyBytes = len(body)
		if utf8.Valid(body) {
			p.BodyText = string(body)
		} else {
			p.BodyHex = hex.Dump(body)
		}
		for k, v := range res.GetMetadata() {
			p.Metadata = append(p.Metadata, [2]string{k, v})
		}
		slices.SortFunc(p.Metadata, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	}
	if data := rec.GetCheckpoint().GetData(); utf8.Valid(data) {
		p.CheckpointText = string(data)
	} else {
		p.CheckpointHex = hex.Dump(data)
	}
	c.render(w, r, http.StatusOK, "record", view{Title: "Record " + rec.GetKey(), Tenant: tenantOf(md), Flash: flashes[q.Get("done")], Page: p})
}

// confirmPage is a confirmation form's data.
type confirmPage struct {
	Action string // completed, retryable or forget
	Record *idempotencyv1.Record
}

func (c *Console) confirm(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	action := q.Get("action")
	if action != "completed" && action != "retryable" && action != "forget" {
		c.renderError(w, r, http.StatusBadRequest, "Unknown action.")
		return
	}
	var md metadata.MD
	resp, err := c.admin.GetRecord(callContext(r), &idempotencyv1.GetRecordRequest{Scope: q.Get("scope"), Key: q.Get("key")}, grpc.Header(&md))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	title := "Forget " + resp.GetRecord().GetKey() + "?"
	if action != "forget" {
		title = "Resolve " + resp.GetRecord().GetKey() + " as " + action + "?"
	}
	c.render(w, r, http.StatusOK, "confirm", view{Title: title, Tenant: tenantOf(md), Page: confirmPage{Action: action, Record: resp.GetRecord()}})
}

// confirmed reports whether a posted action form is the confirmation of
// its own key (the confirmation page sets confirm to the key it names).
func confirmed(r *http.Request) bool {
	return r.PostFormValue("key") != "" && r.PostFormValue("confirm") == r.PostFormValue("key")
}

func (c *Console) resolve(w http.ResponseWriter, r *http.Request) {
	if !c.parsePost(w, r) {
		return
	}
	if !confirmed(r) {
		c.renderError(w, r, http.StatusBadRequest, "Confirm the action on its confirmation page.")
		return
	}
	scope, key, as := r.PostFormValue("scope"), r.PostFormValue("key"), r.PostFormValue("as")
	req := &idempotencyv1.ResolveRequest{Scope: scope, Key: key}
	switch as {
	case "completed":
		req.Resolution = idempotencyv1.Resolution_RESOLUTION_COMPLETED
		res, err := responseFromForm(r)
		if err != nil {
			c.renderError(w, r, http.StatusBadRequest, err.Error())
			return
		}
		req.Response = res
	case "retryable":
		req.Resolution = idempotencyv1.Resolution_RESOLUTION_RETRYABLE
	default:
		c.renderError(w, r, http.StatusBadRequest, "Resolve as completed or retryable.")
		return
	}
	var md metadata.MD
	_, err := c.admin.Resolve(callContext(r), req, grpc.Header(&md))
	if err != nil {
		c.opts.logger.Warn("console: resolve refused", "tenant", tenantOf(md), "scope", scope, "key", key, "as", as,
			"code", statusCode(err), "remote", r.RemoteAddr)
		c.fail(w, r, err)
		return
	}
	c.opts.logger.Info("console: record resolved", "tenant", tenantOf(md), "scope", scope, "key", key, "as", as,
		"remote", r.RemoteAddr)
	http.Redirect(w, r, string(recordURL(scope, key))+"&done="+as, http.StatusSeeOther)
}

// responseFromForm builds the response a "resolve as completed" form
// stores: the uploaded file's bytes, or else the pasted text with its line
// ends turned into \n (browsers send \r\n), and the optional fields.
func responseFromForm(r *http.Request) (*idempotencyv1.StoredResponse, error) {
	res := &idempotencyv1.StoredResponse{
		SchemaVersion: strings.TrimSpace(r.PostFormValue("schema_version")),
		ContentType:   strings.TrimSpace(r.PostFormValue("content_type")),
		Body:          []byte(strings.ReplaceAll(r.PostFormValue("body"), "\r\n", "\n")),
	}
	if f, hdr, err := r.FormFile("body_file"); err == nil {
		defer func() { _ = f.Close() }()
		if hdr.Filename != "" || hdr.Size > 0 {
			b, err := io.ReadAll(f)
			if err != nil {
				return nil, fmt.Errorf("reading the uploaded file: %w", err)
			}
			if len(b) > 0 || strings.TrimSpace(r.PostFormValue("body")) == "" {
				res.Body = b
			}
		}
	}
	for i, line := range strings.Split(strings.ReplaceAll(r.PostFormValue("metadata"), "\r\n", "\n"), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(name) == "" {
			return nil, fmt.Errorf("metadata line %d: write name: value", i+1)
		}
		if res.Metadata == nil {
			res.Metadata = map[string]string{}
		}
		res.Metadata[strings.TrimSpace(name)] = strings.TrimSpace(value)
	}
	if s := strings.TrimSpace(r.PostFormValue("status_code")); s != "" {
		n, err := strconv.ParseInt(s, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("status code %q is not a 32-bit integer", s)
		}
		res.StatusCode = int32(n)
	}
	return res, nil
}

func (c *Console) forget(w http.ResponseWriter, r *http.Request) {
	if !c.parsePost(w, r) {
		return
	}
	if !confirmed(r) {
		c.renderError(w, r, http.StatusBadRequest, "Confirm the action on its confirmation page.")
		return
	}
	scope, key := r.PostFormValue("scope"), r.PostFormValue("key")
	var md metadata.MD
	_, err := c.admin.Forget(callContext(r), &idempotencyv1.ForgetRequest{Scope: scope, Key: key}, grpc.Header(&md))
	if err != nil {
		c.opts.logger.Warn("console: forget refused", "tenant", tenantOf(md), "scope", scope, "key", key,
			"code", statusCode(err), "remote", r.RemoteAddr)
		c.fail(w, r, err)
		return
	}
	c.opts.logger.Info("console: record forgotten", "tenant", tenantOf(md), "scope", scope, "key", key, "remote", r.RemoteAddr)
	http.Redirect(w, r, "/console/records?done=forgotten", http.StatusSeeOther)
}
