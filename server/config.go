package server

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// Config is the coordinator's YAML configuration file. Every part is
// optional; an absent file means the built-in defaults.
type Config struct {
	// Defaults is the policy of scopes no entry of Scopes matches.
	Defaults PolicyConfig `yaml:"defaults"`
	// Scopes are per-scope overrides; the first entry whose Match matches
	// the scope wins. In Match, `*` matches any run of bytes, `/` included.
	Scopes []ScopeConfig `yaml:"scopes"`
	// Limits bound request fields.
	Limits LimitsConfig `yaml:"limits"`
	// Tenants lists who may call. No tenants means auth is disabled and
	// every caller is tenant "default".
	Tenants []TenantConfig `yaml:"tenants"`
	// RateLimit, when set, limits every tenant's calls.
	RateLimit *RateLimitConfig `yaml:"rate_limit"`
	// Reaper tunes background cleanup.
	Reaper ReaperConfig `yaml:"reaper"`
	// Encryption, when set, encrypts stored responses at rest. It is read
	// at start-up; a reload does not change the keys in use.
	Encryption *EncryptionConfig `yaml:"encryption"`
}

// EncryptionConfig seals every record's sensitive columns (the stored
// response's body and metadata, the failure reason) with AES-256-GCM, bound
// to the record, and stores fingerprints as keyed hashes. New rows use
// ActiveKey; rows written under any listed key stay readable, so a key is
// rotated by adding a new one, making it active, and removing the old one
// only once no row uses it (after the longest ttl).
type EncryptionConfig struct {
	ActiveKey string                `yaml:"active_key"`
	Keys      []EncryptionKeyConfig `yaml:"keys"`
	// AcceptLegacyRows reads rows stored in clear or sealed by versions
	// before seal_version 2 instead of answering them DATA_LOSS, and
	// converts them at start-up. For the upgrade (or encryption switch-on)
	// window only: while it is on, rows planted in clear by a database
	// writer are served.
	AcceptLegacyRows bool `yaml:"accept_legacy_rows"`
}

// EncryptionKeyConfig names a 32-byte key, written base64-encoded in a file
// or an environment variable (e.g. from `head -c 32 /dev/urandom | base64`).
type EncryptionKeyConfig struct {
	ID   string `yaml:"id"`
	File string `yaml:"file"`
	Env  string `yaml:"env"`
}

// ReaperConfig tunes the reaper that every replica runs: it marks stale
// leases UNKNOWN, expires terminal records past expires_at (dropping their
// response), deletes EXPIRED records after a retention period, moves old
// UNKNOWN records to the archive and deletes archived records after the
// archive retention.
type ReaperConfig struct {
	// Interval between passes (default 10s); "0s" disables the reaper. A
	// pass that stops with work left (20 full batches of one kind) is
	// followed at once by the next, so a backlog drains at the database's
	// pace rather than 20 batches per interval.
	Interval *Duration `yaml:"interval"`
	// BatchSize is the most rows one statement changes (default 500).
	BatchSize int `yaml:"batch_size"`
	// ExpiredRetention is how long EXPIRED records are kept after
	// expires_at before deletion (default 24h). Under on_expired: reject,
	// the key is new again once its record is deleted.
	ExpiredRetention *Duration `yaml:"expired_retention"`
	// ArchiveRetention is how long an archived record (see the policy's
	// unknown_retention) is kept, counted from when it was archived,
	// before the reaper deletes it for good (default 2160h, 90 days);
	// "0s" keeps the archive forever.
	ArchiveRetention *Duration `yaml:"archive_retention"`
}

// ReaperSettings are the resolved reaper settings.
type ReaperSettings struct {
	Interval         time.Duration
	BatchSize        int
	ExpiredRetention time.Duration
	// ArchiveRetention is 0 when the archive is kept forever.
	ArchiveRetention time.Duration
}

// defaultArchiveRetention is reaper.archive_retention's default: 90 days.
const defaultArchiveRetention = 90 * 24 * time.Hour

// TenantConfig is one tenant. A caller is this tenant when it presents a
// bearer token whose SHA-256 is TokenSHA256, or a verified TLS client
// certificate whose subject common name or one of whose URI SANs is listed,
// exactly, in ClientCertNames. A tenant's Name alone never matches a
// certificate. A tenant needs at least one of the two.
type TenantConfig struct {
	// Name identifies the tenant: it separates its records from every
	// other tenant's. Printable (valid UTF-8, no control characters).
	Name string `yaml:"name"`
	// TokenSHA256 is the hex SHA-256 of the tenant's bearer token (the
	// token itself is never stored). Optional for certificate-only tenants.
	TokenSHA256 string `yaml:"token_sha256"`
	// ClientCertNames are the exact subject common names and URI SANs
	// (e.g. "spiffe://example.org/ci") of the client certificates that
	// authenticate as this tenant. Empty: certificates never do.
	ClientCertNames []string `yaml:"client_cert_names"`
	// Scopes are the scope globs the tenant may use (`*` matches any run of
	// bytes); ["*"] allows all.
	Scopes []string `yaml:"scopes"`
	// Admin allows the tenant to call the Admin service.
	Admin bool `yaml:"admin"`
}

// RateLimitConfig is a per-tenant token bucket.
type RateLimitConfig struct {
	// RequestsPerSecond is the sustained rate of calls per tenant.
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	// Burst is how many calls may come at once (default: one second's worth).
	Burst int `yaml:"burst"`
}

// PolicyConfig is a policy as written in the file; unset fields inherit
// (scope entries from defaults, defaults from the built-in defaults).
type PolicyConfig struct {
	TTL         *Duration `yaml:"ttl"`
	FailureTTL  *Duration `yaml:"failure_ttl"`
	Lease       *Duration `yaml:"lease"`
	MaxTTL      *Duration `yaml:"max_ttl"`
	OnExpired   *string   `yaml:"on_expired"`
	OnUnknown   *string   `yaml:"on_unknown"`
	MaxAttempts *int32    `yaml:"max_attempts"`
	// UnknownRetention is how long an UNKNOWN record (or an IN_PROGRESS
	// one whose lease lapsed) stays in the live table before the reaper
	// moves it to the archive (default 720h, 30 days).
	UnknownRetention *Duration `yaml:"unknown_retention"`
	// KeyPattern is the format every key of the scope must have: an RE2
	// expression that the whole key must match (it is anchored at both
	// ends), or the shorthand "uuid" (a UUID in its canonical
	// 8-4-4-4-12 hex form, any case). A Begin whose key does not match
	// fails INVALID_ARGUMENT with ErrorInfo reason KEY_FORMAT and writes
	// nothing. Empty (the default): any key.
	KeyPattern *string `yaml:"key_pattern"`
}

// ScopeConfig is one per-scope entry.
type ScopeConfig struct {
	Match        string `yaml:"match"`
	PolicyConfig `yaml:",inline"`
}

// LimitsConfig overrides the built-in request limits (see DefaultLimits).
type LimitsConfig struct {
	MaxKeyBytes         *int      `yaml:"max_key_bytes"`
	MaxScopeBytes       *int      `yaml:"max_scope_bytes"`
	MaxFingerprintBytes *int      `yaml:"max_fingerprint_bytes"`
	MaxReasonBytes      *int      `yaml:"max_reason_bytes"`
	MaxResponseBytes    *int      `yaml:"max_response_bytes"`
	MaxCheckpointBytes  *int      `yaml:"max_checkpoint_bytes"`
	MinLease            *Duration `yaml:"min_lease"`
	MaxLease            *Duration `yaml:"max_lease"`
	MaxWait             *Duration `yaml:"max_wait"`
}

// Duration is a time.Duration written in YAML as a Go duration string
// ("24h", "300s", "1h30m").
type Duration time.Duration

// UnmarshalYAML parses a duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return fmt.Errorf("line %d: want a duration such as \"30s\" or \"24h\"", n.Line)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("line %d: %q is not a duration (write e.g. \"30s\", \"24h\")", n.Line, s)
	}
	*d = Duration(v)
	return nil
}

// Policy is the resolved policy of one scope.
type Policy struct {
	TTL         time.Duration
	FailureTTL  time.Duration
	Lease       time.Duration
	MaxTTL      time.Duration
	OnExpired   statemachine.OnExpired
	OnUnknown   statemachine.OnUnknown
	MaxAttempts int32
	// UnknownRetention: see PolicyConfig.UnknownRetention.
	UnknownRetention time.Duration
	// KeyPattern is the compiled PolicyConfig.KeyPattern, anchored; nil
	// accepts every key.
	KeyPattern *regexp.Regexp
}

// KeyPatternUUID is the key_pattern shorthand for a UUID in its canonical
// 8-4-4-4-12 hex form, any case.
const KeyPatternUUID = "uuid"

// uuidKeyPattern is what KeyPatternUUID stands for.
const uuidKeyPattern = `[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}`

// compileKeyPattern compiles a key_pattern: "" accepts every key, "uuid" is
// KeyPatternUUID, anything else an RE2 expression the whole key must match.
func compileKeyPattern(pattern string) (*regexp.Regexp, error) {
	switch pattern {
	case "":
		return nil, nil
	case KeyPatternUUID:
		pattern = uuidKeyPattern
	}
	re, err := regexp.Compile(`\A(?:` + pattern + `)\z`)
	if err != nil {
		return nil, fmt.Errorf("key_pattern %q: not an RE2 expression (or \"uuid\"): %w", pattern, err)
	}
	return re, nil
}

// DefaultPolicy is the built-in policy: ttl 24h, failure_ttl 1h, lease 30s,
// on_expired restart, on_unknown takeover, max_attempts 0 (unlimited),
// max_ttl 720h, unknown_retention 720h.
func DefaultPolicy() Policy {
	return Policy{TTL: 24 * time.Hour, FailureTTL: time.Hour, Lease: 30 * time.Second,
		MaxTTL: 720 * time.Hour, OnExpired: statemachine.ExpiredRestart,
		OnUnknown: statemachine.UnknownTakeover, UnknownRetention: 720 * time.Hour}
}

// Limits bound the fields of requests.
type Limits struct {
	MaxKeyBytes         int
	MaxScopeBytes       int
	MaxFingerprintBytes int
	MaxReasonBytes      int
	MaxResponseBytes    int
	// MaxCheckpointBytes bounds a checkpoint's data.
	MaxCheckpointBytes int
	MinLease           time.Duration
	MaxLease           time.Duration
	MaxWait            time.Duration
}

// DefaultLimits are the documented limits (docs/security.md): key and scope ≤ 255 bytes,
// fingerprint ≤ 64 bytes, reason ≤ 1 KiB, stored response ≤ 1 MiB,
// checkpoint data ≤ 64 KiB, lease 1 s – 1 h, wait ≤ 30 s.
func DefaultLimits() Limits {
	return Limits{MaxKeyBytes: 255, MaxScopeBytes: 255, MaxFingerprintBytes: 64,
		MaxReasonBytes: 1024, MaxResponseBytes: 1 << 20, MaxCheckpointBytes: 64 << 10, MinLease: time.Second,
		MaxLease: time.Hour, MaxWait: 30 * time.Second}
}

// Policies is a validated, resolved configuration: the policy of every scope
// and the limits. It is immutable.
type Policies struct {
	defaults  Policy
	scopes    []scopePolicy
	limits    Limits
	tenants   []tenant
	rateLimit *RateLimitConfig
	reaper    ReaperSettings
	keyring   *ledger.Keyring
	// empty: the file held no YAML document (nothing, or only comments).
	empty bool
}

// tenant is a validated TenantConfig.
type tenant struct {
	name      string
	token     []byte   // SHA-256 of the token, nil for certificate-only tenants
	certNames []string // exact certificate CNs / URI SANs that name this tenant
	scopes    []string
	admin     bool
}

type scopePolicy struct {
	match  string
	policy Policy
}

// DefaultPolicies returns the configuration used without a file.
func DefaultPolicies() *Policies {
	return &Policies{defaults: DefaultPolicy(), limits: DefaultLimits(), reaper: defaultReaper()}
}

// For returns the policy of scope.
func (p *Policies) For(scope string) Policy {
	for _, s := range p.scopes {
		if globMatch(s.match, scope) {
			return s.policy
		}
	}
	return p.defaults
}

// scopeLabel is the metrics label of scope: the scope itself when a
// `scopes:` entry names it exactly, the entry's match pattern when the
// first entry matching it is a glob, and "other" for every scope the file
// does not name. The label set is thus fixed by the operator, never grown
// by callers, and reveals no scope the operator did not write down.
func (p *Policies) scopeLabel(scope string) string {
	for _, s := range p.scopes {
		if globMatch(s.match, scope) {
			if !strings.Contains(s.match, "*") {
				return scope
			}
			return s.match
		}
	}
	return otherScope
}

func defaultReaper() ReaperSettings {
	return ReaperSettings{Interval: 10 * time.Second, BatchSize: 500, ExpiredRetention: 24 * time.Hour,
		ArchiveRetention: defaultArchiveRetention}
}

// Keyring returns the keys that encrypt stored responses, or nil when
// encryption is off.
func (p *Policies) Keyring() *ledger.Keyring { return p.keyring }

func (e *EncryptionConfig) keyring() (*ledger.Keyring, error) {
	keys := map[string][]byte{}
	for i, kc := range e.Keys {
		var text string
		switch {
		case kc.ID == "":
			return nil, fmt.Errorf("keys[%d]: id is required", i)
		case (kc.File == "") == (kc.Env == ""):
			return nil, fmt.Errorf("key %q: give exactly one of file or env", kc.ID)
		case kc.File != "":
			data, err := readKeyFile(kc.File)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", kc.ID, err)
			}
			text = string(data)
		default:
			v, ok := os.LookupEnv(kc.Env)
			if !ok {
				return nil, fmt.Errorf("key %q: environment variable %s is not set", kc.ID, kc.Env)
			}
			text = v
		}
		key, err := base64.StdEncoding.DecodeString(strings.TrimSpace(text))
		if err != nil || len(key) != ledger.KeySize {
			return nil, fmt.Errorf("key %q: want %d random bytes, base64-encoded (head -c 32 /dev/urandom | base64)", kc.ID, ledger.KeySize)
		}
		if _, dup := keys[kc.ID]; dup {
			return nil, fmt.Errorf("key %q is listed twice", kc.ID)
		}
		keys[kc.ID] = key
	}
	k, err := ledger.NewKeyring(e.ActiveKey, keys)
	if err != nil || !e.AcceptLegacyRows {
		return k, err
	}
	return k.AcceptingLegacyRows(), nil
}

// maxKeyFileBytes bounds a key file: 32 bytes in base64 and white space.
const maxKeyFileBytes = 4096

// readKeyFile reads a key file, which must be a regular file (a symbolic
// link to one is fine) of at most maxKeyFileBytes: never a device or pipe
// that would block or never end.
func readKeyFile(path string) ([]byte, error) {
	f, err := os.Open(path) //nolint:gosec // the operator names this file (flag, environment or config file); reading it is the point
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxKeyFileBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxKeyFileBytes {
		return nil, fmt.Errorf("%s is larger than a key file (%d bytes at most)", path, maxKeyFileBytes)
	}
	return data, nil
}

// unknownRetention returns the default unknown retention and the
// per-scope ones, in the order the scopes are matched.
func (p *Policies) unknownRetention() (time.Duration, []ledger.ScopeRetention) {
	rules := make([]ledger.ScopeRetention, len(p.scopes))
	for i, sc := range p.scopes {
		rules[i] = ledger.ScopeRetention{Glob: sc.match, Retention: sc.policy.UnknownRetention}
	}
	return p.defaults.UnknownRetention, rules
}

// Reaper returns the reaper settings.
func (p *Policies) Reaper() ReaperSettings { return p.reaper }

// AuthEnabled reports whether tenants are configured.
func (p *Policies) AuthEnabled() bool { return len(p.tenants) > 0 }

// Limits returns the request limits.
func (p *Policies) Limits() Limits { return p.limits }

// LoadPolicies reads and validates the YAML file at path.
func LoadPolicies(path string) (*Policies, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the operator names this file (flag, environment or config file); reading it is the point
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	p, err := ParsePolicies(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return p, nil
}

// ParsePolicies parses and validates a YAML configuration. Unknown keys are
// errors, so a misspelt setting is never silently ignored.
func ParsePolicies(data []byte) (*Policies, error) {
	var cfg Config
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	err := dec.Decode(&cfg)
	empty := errors.Is(err, io.EOF) // no document: an empty file, or only comments
	if err != nil && !empty {
		return nil, err
	}
	p, err := cfg.Resolve()
	if err != nil {
		return nil, err
	}
	p.empty = empty
	return p, nil
}

// Resolve validates cfg and merges it over the built-in defaults.
func (cfg *Config) Resolve() (*Policies, error) {
	var errs []error
	defaults, err := cfg.Defaults.apply(DefaultPolicy())
	if err != nil {
		errs = append(errs, fmt.Errorf("defaults: %w", err))
	}
	out := &Policies{defaults: defaults}
	for i, s := range cfg.Scopes {
		if s.Match == "" {
			errs = append(errs, fmt.Errorf("scopes[%d]: match is required", i))
			continue
		}
		p, err := s.PolicyConfig.apply(defaults)
		if err != nil {
			errs = append(errs, fmt.Errorf("scopes[%d] (match %q): %w", i, s.Match, err))
			continue
		}
		out.scopes = append(out.scopes, scopePolicy{match: s.Match, policy: p})
	}
	limits, err := cfg.Limits.apply(DefaultLimits())
	if err != nil {
		errs = append(errs, fmt.Errorf("limits: %w", err))
	}
	out.limits = limits
	errs = append(errs, out.resolveTenants(cfg.Tenants)...)
	if err := checkIdentityLimits(out.limits, out.tenants); err != nil {
		errs = append(errs, err)
	}
	if rl := cfg.RateLimit; rl != nil {
		if rl.RequestsPerSecond <= 0 || rl.Burst < 0 {
			errs = append(errs, errors.New("rate_limit: requests_per_second must be positive and burst not negative"))
		} else {
			r := *rl
			if r.Burst == 0 {
				r.Burst = max(1, int(r.RequestsPerSecond))
			}
			out.rateLimit = &r
		}
	}
	out.reaper = defaultReaper()
	r := cfg.Reaper
	if r.Interval != nil {
		out.reaper.Interval = time.Duration(*r.Interval)
	}
	if r.ExpiredRetention != nil {
		out.reaper.ExpiredRetention = time.Duration(*r.ExpiredRetention)
	}
	if r.BatchSize != 0 {
		out.reaper.BatchSize = r.BatchSize
	}
	if out.reaper.Interval < 0 || out.reaper.ExpiredRetention < 0 || out.reaper.BatchSize < 0 {
		errs = append(errs, errors.New("reaper: interval, batch_size and expired_retention must not be negative"))
	}
	if r.ArchiveRetention != nil {
		out.reaper.ArchiveRetention = time.Duration(*r.ArchiveRetention)
		if out.reaper.ArchiveRetention < 0 {
			errs = append(errs, fmt.Errorf("reaper: archive_retention %v: must not be negative (0s keeps the archive forever)",
				out.reaper.ArchiveRetention))
		}
	}
	if cfg.Encryption != nil {
		k, err := cfg.Encryption.keyring()
		if err != nil {
			errs = append(errs, fmt.Errorf("encryption: %w", err))
		}
		out.keyring = k
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// resolveTenants validates the tenants and adds them to p. Two tenants may
// not share a name, a token hash or a certificate name: any of those would
// let one tenant's credentials select another.
func (p *Policies) resolveTenants(tcs []TenantConfig) []error {
	var errs []error
	names, tokens, certs := map[string]int{}, map[string]int{}, map[string]int{}
	for i, tc := range tcs {
		tn, err := tc.resolve()
		if err != nil {
			errs = append(errs, fmt.Errorf("tenants[%d]: %w", i, err))
			continue
		}
		var dups []error
		if j, dup := names[tn.name]; dup {
			dups = append(dups, fmt.Errorf("name %q is used by tenants[%d] too", tn.name, j))
		}
		if tn.token != nil {
			if j, dup := tokens[string(tn.token)]; dup {
				dups = append(dups, fmt.Errorf("tenant %q: token_sha256 is the same as tenants[%d]'s: one token would select two tenants", tn.name, j))
			}
			tokens[string(tn.token)] = i
		}
		for _, cn := range tn.certNames {
			if j, dup := certs[cn]; dup {
				dups = append(dups, fmt.Errorf("tenant %q: client certificate name %q is listed twice (also by tenants[%d])", tn.name, cn, j))
			}
			certs[cn] = i
		}
		names[tn.name] = i
		if len(dups) > 0 {
			errs = append(errs, fmt.Errorf("tenants[%d]: %w", i, errors.Join(dups...)))
			continue
		}
		p.tenants = append(p.tenants, tn)
	}
	return errs
}

// checkIdentityLimits refuses limits under which a key could not be
// stored: the longest tenant name plus max_scope_bytes plus max_key_bytes
// must fit the primary key index (ledger.MaxIdentityBytes).
func checkIdentityLimits(l Limits, tenants []tenant) error {
	longest := len(ledger.DefaultTenant)
	for _, t := range tenants {
		longest = max(longest, len(t.name))
	}
	if n := longest + l.MaxScopeBytes + l.MaxKeyBytes; n > ledger.MaxIdentityBytes {
		return fmt.Errorf("limits: max_key_bytes %d + max_scope_bytes %d + the longest tenant name (%d bytes) = %d bytes, "+
			"more than the %d bytes the database index can store for one record; lower max_key_bytes or max_scope_bytes",
			l.MaxKeyBytes, l.MaxScopeBytes, longest, n, ledger.MaxIdentityBytes)
	}
	return nil
}

func (tc TenantConfig) resolve() (tenant, error) {
	tn := tenant{name: tc.Name, scopes: tc.Scopes, admin: tc.Admin}
	if tc.Name == "" {
		return tn, errors.New("name is required")
	}
	if !printableName(tc.Name) {
		return tn, fmt.Errorf("name %q: must be valid UTF-8 without control characters", tc.Name)
	}
	for _, cn := range tc.ClientCertNames {
		if cn == "" || !printableName(cn) {
			return tn, fmt.Errorf("tenant %q: client_cert_names entry %q: must be a non-empty printable certificate CN or URI SAN", tc.Name, cn)
		}
		tn.certNames = append(tn.certNames, cn)
	}
	if tc.TokenSHA256 != "" {
		sum, err := hex.DecodeString(tc.TokenSHA256)
		if err != nil || len(sum) != sha256.Size {
			return tn, fmt.Errorf("tenant %q: token_sha256 must be 64 hex digits (the SHA-256 of the token, e.g. from `printf %%s TOKEN | sha256sum`)", tc.Name)
		}
		tn.token = sum
	}
	if tn.token == nil && len(tn.certNames) == 0 {
		return tn, fmt.Errorf("tenant %q: give token_sha256, client_cert_names or both: no caller could authenticate as it", tc.Name)
	}
	if len(tc.Scopes) == 0 {
		return tn, fmt.Errorf("tenant %q: scopes is required (use [\"*\"] to allow every scope)", tc.Name)
	}
	return tn, nil
}

func (c PolicyConfig) apply(p Policy) (Policy, error) {
	set := func(dst *time.Duration, src *Duration) {
		if src != nil {
			*dst = time.Duration(*src)
		}
	}
	set(&p.TTL, c.TTL)
	set(&p.FailureTTL, c.FailureTTL)
	set(&p.Lease, c.Lease)
	set(&p.MaxTTL, c.MaxTTL)
	set(&p.UnknownRetention, c.UnknownRetention)
	if c.MaxAttempts != nil {
		p.MaxAttempts = *c.MaxAttempts
	}
	var errs []error
	if c.OnExpired != nil {
		switch strings.ToLower(*c.OnExpired) {
		case "restart":
			p.OnExpired = statemachine.ExpiredRestart
		case "reject":
			p.OnExpired = statemachine.ExpiredReject
		default:
			errs = append(errs, fmt.Errorf("on_expired %q: want restart or reject", *c.OnExpired))
		}
	}
	if c.OnUnknown != nil {
		switch strings.ToLower(*c.OnUnknown) {
		case "takeover":
			p.OnUnknown = statemachine.UnknownTakeover
		case "hold":
			p.OnUnknown = statemachine.UnknownHold
		default:
			errs = append(errs, fmt.Errorf("on_unknown %q: want takeover or hold", *c.OnUnknown))
		}
	}
	if p.MaxTTL <= 0 {
		errs = append(errs, fmt.Errorf("max_ttl %v: must be positive", p.MaxTTL))
	}
	if p.TTL <= 0 || p.TTL > p.MaxTTL {
		errs = append(errs, fmt.Errorf("ttl %v: must be positive and at most max_ttl (%v)", p.TTL, p.MaxTTL))
	}
	if p.FailureTTL <= 0 {
		errs = append(errs, fmt.Errorf("failure_ttl %v: must be positive", p.FailureTTL))
	}
	if p.Lease < time.Second || p.Lease > time.Hour {
		errs = append(errs, fmt.Errorf("lease %v: must be between 1s and 1h", p.Lease))
	}
	if p.UnknownRetention <= 0 {
		errs = append(errs, fmt.Errorf("unknown_retention %v: must be positive", p.UnknownRetention))
	}
	if p.MaxAttempts < 0 {
		errs = append(errs, fmt.Errorf("max_attempts %d: must be 0 (unlimited) or more", p.MaxAttempts))
	}
	if c.KeyPattern != nil {
		re, err := compileKeyPattern(*c.KeyPattern)
		if err != nil {
			errs = append(errs, err)
		}
		p.KeyPattern = re
	}
	return p, errors.Join(errs...)
}

// maxStoredBytes bounds limits.max_response_bytes and
// limits.max_checkpoint_bytes together: a record's answer carries both,
// and must fit in one gRPC message (grpcMaxMessageBytes, the limit of the
// coordinator's listener and gRPC clients' default) with 64 KiB to spare
// for the identity, tokens, reasons and framing.
const maxStoredBytes = grpcMaxMessageBytes - 64<<10

func (c LimitsConfig) apply(l Limits) (Limits, error) {
	var errs []error
	setInt := func(name string, dst *int, src *int) {
		if src == nil {
			return
		}
		if *src <= 0 {
			errs = append(errs, fmt.Errorf("%s %d: must be positive", name, *src))
			return
		}
		*dst = *src
	}
	setInt("max_key_bytes", &l.MaxKeyBytes, c.MaxKeyBytes)
	setInt("max_scope_bytes", &l.MaxScopeBytes, c.MaxScopeBytes)
	setInt("max_fingerprint_bytes", &l.MaxFingerprintBytes, c.MaxFingerprintBytes)
	setInt("max_reason_bytes", &l.MaxReasonBytes, c.MaxReasonBytes)
	setInt("max_response_bytes", &l.MaxResponseBytes, c.MaxResponseBytes)
	setInt("max_checkpoint_bytes", &l.MaxCheckpointBytes, c.MaxCheckpointBytes)
	if l.MaxResponseBytes+l.MaxCheckpointBytes > maxStoredBytes {
		errs = append(errs, fmt.Errorf("max_response_bytes %d + max_checkpoint_bytes %d: at most %d together, so that a record carrying both "+
			"(a replay's answer, a Lookup's) fits in one gRPC message of %d bytes with its identity and other fields",
			l.MaxResponseBytes, l.MaxCheckpointBytes, maxStoredBytes, grpcMaxMessageBytes))
	}
	if c.MinLease != nil {
		l.MinLease = time.Duration(*c.MinLease)
	}
	if c.MaxLease != nil {
		l.MaxLease = time.Duration(*c.MaxLease)
	}
	if c.MaxWait != nil {
		l.MaxWait = time.Duration(*c.MaxWait)
	}
	if l.MinLease <= 0 || l.MaxLease < l.MinLease {
		errs = append(errs, fmt.Errorf("min_lease %v / max_lease %v: want 0 < min_lease <= max_lease", l.MinLease, l.MaxLease))
	}
	if l.MaxWait < 0 {
		errs = append(errs, fmt.Errorf("max_wait %v: must not be negative", l.MaxWait))
	}
	return l, errors.Join(errs...)
}

// globMatch reports whether name matches pattern, in which `*` matches any
// run of bytes (including `/`) and every other byte matches itself.
func globMatch(pattern, name string) bool {
	// Iterative matcher with backtracking to the last star.
	p, n := 0, 0
	star, mark := -1, 0
	for n < len(name) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			star, mark = p, n
			p++
		case p < len(pattern) && pattern[p] == name[n]:
			p++
			n++
		case star >= 0:
			p = star + 1
			mark++
			n = mark
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}
