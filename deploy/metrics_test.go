package deploy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// targetLabels are the labels Prometheus adds to every scraped series.
var targetLabels = []string{"job", "instance", "namespace", "pod", "service", "container", "endpoint"}

// exportedMetrics reads testdata/exported-metrics.txt (written from the real
// binary's /metrics by TestExportedMetricsList in cmd/idemcoord): metric
// name → its label names.
func exportedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "exported-metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	metrics := map[string][]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, labels, ok := strings.Cut(strings.TrimSuffix(line, "}"), "{")
		if !ok {
			t.Fatalf("exported-metrics.txt: bad line %q", line)
		}
		metrics[name] = nil
		if labels != "" {
			metrics[name] = strings.Split(labels, ",")
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(metrics) < 10 {
		t.Fatalf("exported-metrics.txt lists %d metrics", len(metrics))
	}
	return metrics
}

// selector is a metric named in a PromQL expression, with the labels its
// matchers name.
type selector struct {
	metric string
	labels []string
}

var (
	aggregations = []string{"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
	grouping     = []string{"by", "without", "on", "ignoring", "group_left", "group_right"}
	keywords     = []string{"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"}
)

// parsePromQL returns the metrics an expression selects (with their
// matchers' labels) and the labels of its by/without/on/ignoring clauses.
// It is a lexer, not a parser: enough to find names in the expressions of
// alerts and dashboards, which promtool and Grafana parse for real.
func parsePromQL(expr string) (sels []selector, groupLabels []string, err error) {
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	i := 0
	skipSpace := func() {
		for i < len(expr) && strings.IndexByte(" \t\r\n", expr[i]) >= 0 {
			i++
		}
	}
	ident := func() string {
		start := i
		for i < len(expr) && isIdent(expr[i]) {
			i++
		}
		return expr[start:i]
	}
	skipString := func() error {
		quote := expr[i]
		for i++; i < len(expr); i++ {
			switch {
			case expr[i] == '\\' && quote != '`':
				i++
			case expr[i] == quote:
				i++
				return nil
			}
		}
		return fmt.Errorf("unterminated string in %q", expr)
	}
	for i < len(expr) {
		c := expr[i]
		switch {
		case strings.IndexByte(" \t\r\n", c) >= 0:
			i++
		case c == '"' || c == '\'' || c == '`':
			if err := skipString(); err != nil {
				return nil, nil, err
			}
		case c == '[':
			end := strings.IndexByte(expr[i:], ']')
			if end < 0 {
				return nil, nil, fmt.Errorf("unterminated range in %q", expr)
			}
			i += end + 1
		case c == '{':
			return nil, nil, fmt.Errorf("a selector without a metric name in %q", expr)
		case c == '$':
			i++
			ident()
		case c >= '0' && c <= '9' || c == '.':
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			name := ident()
			skipSpace()
			next := byte(0)
			if i < len(expr) {
				next = expr[i]
			}
			switch {
			case slices.Contains(grouping, name):
				if next != '(' {
					return nil, nil, fmt.Errorf("%s without a label list in %q", name, expr)
				}
				end := strings.IndexByte(expr[i:], ')')
				if end < 0 {
					return nil, nil, fmt.Errorf("unterminated %s list in %q", name, expr)
				}
				for l := range strings.SplitSeq(expr[i+1:i+end], ",") {
					if l = strings.TrimSpace(l); l != "" {
						groupLabels = append(groupLabels, l)
					}
				}
				i += end + 1
			case slices.Contains(aggregations, name), slices.Contains(keywords, name), next == '(':
				// an operator or a function: its arguments follow
			default:
				sel := selector{metric: name}
				if next == '{' {
					i++
					for {
						skipSpace()
						if i >= len(expr) {
							return nil, nil, fmt.Errorf("unterminated selector in %q", expr)
						}
						if expr[i] == '}' {
							i++
							break
						}
						if expr[i] == ',' {
							i++
							continue
						}
						label := ident()
						if label == "" {
							return nil, nil, fmt.Errorf("bad matcher at %q", expr[i:])
						}
						sel.labels = append(sel.labels, label)
						skipSpace()
						for i < len(expr) && strings.IndexByte("=!~", expr[i]) >= 0 {
							i++
						}
						skipSpace()
						if i >= len(expr) || strings.IndexByte("\"'`", expr[i]) < 0 {
							return nil, nil, fmt.Errorf("matcher %s without a string in %q", label, expr)
						}
						if err := skipString(); err != nil {
							return nil, nil, err
						}
					}
				}
				sels = append(sels, sel)
			}
		default:
			i++
		}
	}
	return sels, groupLabels, nil
}

// checkExpr reports each metric an expression names that the binary does
// not export, each matcher label the metric does not carry, and each
// grouping label none of its metrics carries.
func checkExpr(exported map[string][]string, expr string) []string {
	sels, groups, err := parsePromQL(expr)
	if err != nil {
		return []string{err.Error()}
	}
	if len(sels) == 0 {
		return []string{fmt.Sprintf("no metric in %q", expr)}
	}
	var problems []string
	known := slices.Clone(targetLabels)
	for _, s := range sels {
		labels, ok := exported[s.metric]
		if !ok {
			problems = append(problems, fmt.Sprintf("%s is not exported by idemcoord (in %q)", s.metric, expr))
			continue
		}
		known = append(known, labels...)
		for _, l := range s.labels {
			if !slices.Contains(labels, l) && !slices.Contains(targetLabels, l) {
				problems = append(problems, fmt.Sprintf("%s has no label %s (it has %v; in %q)", s.metric, l, labels, expr))
			}
		}
	}
	for _, l := range groups {
		if !slices.Contains(known, l) {
			problems = append(problems, fmt.Sprintf("no metric of %q has the label %s", expr, l))
		}
	}
	return problems
}

func TestParsePromQL(t *testing.T) {
	sels, groups, err := parsePromQL(`histogram_quantile(0.99, sum by (le, grpc_method) (rate(grpc_server_handling_seconds_bucket{job=~"$job",grpc_service="a\"}"}[$__rate_interval]))) / on(instance) time() - max without (pod) (x_total) > 0.5`)
	if err != nil {
		t.Fatal(err)
	}
	want := []selector{{"grpc_server_handling_seconds_bucket", []string{"job", "grpc_service"}}, {"x_total", nil}}
	if fmt.Sprint(sels) != fmt.Sprint(want) || fmt.Sprint(groups) != "[le grpc_method instance pod]" {
		t.Errorf("got %v %v, want %v [le grpc_method instance pod]", sels, groups, want)
	}
	exported := map[string][]string{"a_total": {"scope"}}
	for expr, want := range map[string]int{
		`sum by (scope) (rate(a_total{scope="x",job="j"}[5m]))`: 0,
		`rate(b_total[5m])`:        1,
		`a_total{state="x"}`:       1,
		`sum by (state) (a_total)`: 1,
		`time()`:                   1,
	} {
		if got := checkExpr(exported, expr); len(got) != want {
			t.Errorf("checkExpr(%q) = %q, want %d problems", expr, got, want)
		}
	}
}

// TestAlertsNameExportedMetrics: every metric and label the alert rules
// name is one the binary exports.
func TestAlertsNameExportedMetrics(t *testing.T) {
	exported := exportedMetrics(t)
	data, err := os.ReadFile(filepath.Join("prometheus", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert, Record, Expr string
			}
		}
	}
	if err := yaml.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			n++
			for _, p := range checkExpr(exported, r.Expr) {
				t.Errorf("alert %s: %s", r.Alert+r.Record, p)
			}
		}
	}
	if n < 6 {
		t.Errorf("alerts.yaml holds %d rules", n)
	}
}

// TestAlertRules runs promtool's checks and the rules' unit tests.
func TestAlertRules(t *testing.T) {
	promtool := tool(t, "PROMTOOL", "promtool", "Debian: apt-get install prometheus")
	for _, args := range [][]string{{"check", "rules", "alerts.yaml"}, {"test", "rules", "alerts_test.yaml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "prometheus"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestDashboardNamesExportedMetrics: the dashboard is valid JSON, and every
// query of its panels and variables names metrics and labels the binary
// exports.
func TestDashboardNamesExportedMetrics(t *testing.T) {
	exported := exportedMetrics(t)
	data, err := os.ReadFile(filepath.Join("grafana", "idemcoord.json"))
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string
		Type    string
		Targets []struct{ Expr string }
	}
	var dash struct {
		UID        string
		Title      string
		Panels     []panel
		Templating struct {
			List []struct {
				Name, Type string
				Query      json.RawMessage
			}
		}
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("idemcoord.json: %v", err)
	}
	if dash.UID == "" || dash.Title == "" {
		t.Error("the dashboard has no uid or title")
	}
	queries := 0
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			queries++
			for _, problem := range checkExpr(exported, q.Expr) {
				t.Errorf("panel %q: %s", p.Title, problem)
			}
		}
	}
	if queries < 10 {
		t.Errorf("the dashboard has %d queries", queries)
	}
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Errorf("variable %s: %v", v.Name, err)
			continue
		}
		m := labelValues.FindStringSubmatch(q.Query)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(metric, label)", v.Name, q.Query)
			continue
		}
		for _, problem := range checkExpr(exported, m[1]) {
			t.Errorf("variable %s: %s", v.Name, problem)
		}
		if sels, _, _ := parsePromQL(m[1]); len(sels) == 1 {
			if !slices.Contains(exported[sels[0].metric], m[2]) && !slices.Contains(targetLabels, m[2]) {
				t.Errorf("variable %s: %s has no label %s", v.Name, sels[0].metric, m[2])
			}
		}
	}
}
