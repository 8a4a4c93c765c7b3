package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

const (
	chartDir    = repoRoot + "/deploy/helm/idemcoord"
	kubeVersion = "1.31.0" // any version the chart's kubeVersion admits
)

// The value sets the chart is rendered with, each a way to run it.
var valueSets = []string{"tenants.yaml", "tls.yaml", "insecure.yaml"}

type keyPath struct{ Key, Path string }

type probe struct {
	GRPC *struct {
		Port int
	} `yaml:"grpc"`
	HTTPGet *struct {
		Path   string
		Port   string
		Scheme string
	} `yaml:"httpGet"`
}

type container struct {
	Args []string
	Env  []struct {
		Name      string
		ValueFrom *struct {
			SecretKeyRef *struct{ Name, Key string } `yaml:"secretKeyRef"`
		} `yaml:"valueFrom"`
	}
	Ports []struct {
		Name          string
		ContainerPort int `yaml:"containerPort"`
	}
	StartupProbe    *probe `yaml:"startupProbe"`
	LivenessProbe   *probe `yaml:"livenessProbe"`
	ReadinessProbe  *probe `yaml:"readinessProbe"`
	SecurityContext struct {
		RunAsNonRoot             *bool  `yaml:"runAsNonRoot"`
		RunAsUser                *int64 `yaml:"runAsUser"`
		ReadOnlyRootFilesystem   *bool  `yaml:"readOnlyRootFilesystem"`
		AllowPrivilegeEscalation *bool  `yaml:"allowPrivilegeEscalation"`
		Capabilities             struct{ Drop []string }
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string
		MountPath string `yaml:"mountPath"`
		SubPath   string `yaml:"subPath"`
	} `yaml:"volumeMounts"`
}

type volume struct {
	Name   string
	Secret *struct {
		SecretName string `yaml:"secretName"`
		Items      []keyPath
	}
	ConfigMap *struct {
		Name  string
		Items []keyPath
	} `yaml:"configMap"`
}

// object is one rendered manifest, with the fields of the kinds checked.
type object struct {
	Kind     string
	Metadata struct {
		Name   string
		Labels map[string]string
	}
	Data       map[string]string
	StringData map[string]string `yaml:"stringData"`
	Spec       struct {
		// Deployment, PodDisruptionBudget, ServiceMonitor
		Selector struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		}
		Template struct {
			Metadata struct{ Labels map[string]string }
			Spec     struct {
				Containers []container
				Volumes    []volume
			}
		}
		Endpoints []struct{ Port string }
		// Service
		Ports []struct {
			Name       string
			Port       int
			TargetPort string `yaml:"targetPort"`
		}
	}
	// The Service's selector is a plain map.
	ServiceSelector map[string]string `yaml:"-"`
}

// render runs helm template with the value file and returns the objects by
// kind (one of each kind but Secret).
func render(t *testing.T, helm string, args ...string) ([]object, error) {
	t.Helper()
	cmd := exec.Command(helm, append([]string{"template", "idem", chartDir, "--kube-version", kubeVersion}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, errors.New(strings.TrimSpace(stderr.String()))
	}
	var objs []object
	dec := yaml.NewDecoder(bytes.NewReader(out))
	for {
		var node yaml.Node
		if err := dec.Decode(&node); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("rendered YAML: %v", err)
		}
		var o object
		if err := node.Decode(&o); err != nil {
			t.Fatalf("rendered YAML: %v", err)
		}
		if o.Kind == "Service" {
			var svc struct {
				Spec struct{ Selector map[string]string }
			}
			if err := node.Decode(&svc); err != nil {
				t.Fatal(err)
			}
			o.ServiceSelector = svc.Spec.Selector
		}
		if o.Kind != "" {
			objs = append(objs, o)
		}
	}
	return objs, nil
}

// flagSpec is what `idemcoord --help` says of a flag: whether it takes a value.
type flagSpec struct{ takesValue bool }

// binaryFlags parses the flags out of `idemcoord --help`.
func binaryFlags(t *testing.T, bin string) map[string]flagSpec {
	t.Helper()
	out, _ := exec.Command(bin, "--help").CombinedOutput() // exits 2 after printing
	re := regexp.MustCompile(`(?m)^  -([a-z0-9-]+)(?: (\S+))?$`)
	flags := map[string]flagSpec{}
	for _, m := range re.FindAllStringSubmatch(string(out), -1) {
		flags[m[1]] = flagSpec{takesValue: m[2] != ""}
	}
	if len(flags) < 10 {
		t.Fatalf("found %d flags in idemcoord --help:\n%s", len(flags), out)
	}
	return flags
}

// TestChartRefusesToRunWithoutAuthByDefault: with no tenants and no
// explicit insecureAllowNoAuth the chart does not render, as the binary
// would not start on a pod address without auth.
func TestChartRefusesToRunWithoutAuthByDefault(t *testing.T) {
	helm := tool(t, "HELM", "helm", "make deploy-check installs the pinned helm into ./bin")
	_, err := render(t, helm, "--set", "database.existingSecret=db")
	if err == nil || !strings.Contains(err.Error(), "auth is on by default") {
		t.Errorf("rendered without tenants: err = %v", err)
	}
	_, err = render(t, helm, "--set", "auth.insecureAllowNoAuth=true")
	if err == nil || !strings.Contains(err.Error(), "database.existingSecret is required") {
		t.Errorf("rendered without a database Secret: err = %v", err)
	}
}

// TestChartMatchesBinary renders the chart with each value set and checks
// the Deployment against the binary: every argument is a flag of
// `idemcoord --help` used as the flag expects, the ports and probes are
// those the flags open, every file a flag names is mounted from a volume
// that holds it, the config file the chart writes is one the binary
// accepts (with tenants unless auth is explicitly off), and the pod runs
// as UID 65532 with a read-only root and no capabilities.
func TestChartMatchesBinary(t *testing.T) {
	helm := tool(t, "HELM", "helm", "make deploy-check installs the pinned helm into ./bin")
	bin := coordinator(t)
	flags := binaryFlags(t, bin)
	for _, set := range valueSets {
		t.Run(strings.TrimSuffix(set, ".yaml"), func(t *testing.T) {
			objs, err := render(t, helm, "-f", filepath.Join("testdata", "helm", set))
			if err != nil {
				t.Fatal(err)
			}
			checkRendered(t, bin, flags, objs)
		})
	}
}

func checkRendered(t *testing.T, bin string, flags map[string]flagSpec, objs []object) {
	byKind := map[string][]object{}
	for _, o := range objs {
		byKind[o.Kind] = append(byKind[o.Kind], o)
	}
	if len(byKind["Deployment"]) != 1 || len(byKind["Service"]) != 1 {
		t.Fatalf("want one Deployment and one Service, got %v", byKind)
	}
	dep, svc := byKind["Deployment"][0], byKind["Service"][0]
	pod := dep.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("want one container, got %d", len(pod.Containers))
	}
	c := pod.Containers[0]

	// Arguments: real flags, with a value exactly when the flag takes one.
	args := map[string]string{}
	for _, a := range c.Args {
		name, value, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		spec, ok := flags[name]
		switch {
		case !strings.HasPrefix(a, "--") || !ok:
			t.Errorf("argument %q is not a flag of idemcoord --help", a)
		case spec.takesValue && !hasValue:
			t.Errorf("argument %q: the flag takes a value (write --%s=VALUE)", a, name)
		case !spec.takesValue && hasValue && value != "true" && value != "false":
			t.Errorf("argument %q: the flag is a switch", a)
		}
		args[name] = value
	}

	// Ports: the container's grpc and http ports are those of --listen and
	// --http-listen, and the Service sends its ports to them.
	ports := map[string]int{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for name, flag := range map[string]string{"grpc": "listen", "http": "http-listen"} {
		_, port, err := net.SplitHostPort(args[flag])
		if err != nil {
			t.Errorf("--%s=%q: %v", flag, args[flag], err)
			continue
		}
		if n, _ := strconv.Atoi(port); n == 0 || n != ports[name] {
			t.Errorf("--%s=%s but container port %q is %d", flag, args[flag], name, ports[name])
		}
		found := false
		for _, sp := range svc.Spec.Ports {
			found = found || (sp.Name == name && sp.TargetPort == name)
		}
		if !found {
			t.Errorf("the Service has no port %q targeting the container's", name)
		}
	}
	if !subset(svc.ServiceSelector, dep.Spec.Template.Metadata.Labels) || len(svc.ServiceSelector) == 0 {
		t.Errorf("the Service's selector %v does not select the pods (%v)", svc.ServiceSelector, dep.Spec.Template.Metadata.Labels)
	}

	// Probes: gRPC health on the --listen port, unless TLS is on (the
	// kubelet's gRPC probes are plaintext): then HTTPS /readyz; liveness
	// and start-up on /healthz (any Host) or gRPC health.
	_, tlsOn := args["tls-cert"]
	scheme := "HTTP"
	if tlsOn {
		scheme = "HTTPS"
	}
	checkProbe := func(what string, p *probe, httpPath string) {
		t.Helper()
		switch {
		case p == nil:
			t.Errorf("no %s probe", what)
		case p.GRPC != nil:
			if tlsOn {
				t.Errorf("%s probe: gRPC probes speak plaintext, but --tls-cert is set", what)
			}
			if p.GRPC.Port != ports["grpc"] {
				t.Errorf("%s probe: gRPC port %d, want the --listen port %d", what, p.GRPC.Port, ports["grpc"])
			}
		case p.HTTPGet != nil:
			if p.HTTPGet.Path != httpPath || p.HTTPGet.Port != "http" || p.HTTPGet.Scheme != scheme {
				t.Errorf("%s probe: %s %s on port %q, want %s %s on port \"http\"", what, p.HTTPGet.Scheme, p.HTTPGet.Path, p.HTTPGet.Port, scheme, httpPath)
			}
		default:
			t.Errorf("%s probe is neither gRPC nor HTTP", what)
		}
	}
	checkProbe("readiness", c.ReadinessProbe, "/readyz")
	checkProbe("liveness", c.LivenessProbe, "/healthz")
	checkProbe("startup", c.StartupProbe, "/healthz")
	if !tlsOn && (c.ReadinessProbe == nil || c.ReadinessProbe.GRPC == nil) {
		t.Error("without TLS, readiness should be gRPC health on the --listen port")
	}

	// Files named by flags: each under a mount of a volume holding it.
	volumes := map[string]volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	rendered := map[string]object{} // ConfigMaps and Secrets the chart renders, by name
	for _, o := range append(byKind["ConfigMap"], byKind["Secret"]...) {
		rendered[o.Metadata.Name] = o
	}
	var configFile string
	for _, flag := range []string{"config", "tls-cert", "tls-key", "tls-client-ca", "metrics-token-file"} {
		path, ok := args[flag]
		if !ok {
			continue
		}
		dir, base := filepath.Dir(path), filepath.Base(path)
		var vol *volume
		for _, m := range c.VolumeMounts {
			if m.MountPath == dir && m.SubPath == "" {
				v, ok := volumes[m.Name]
				if ok {
					vol = &v
				}
			}
		}
		if vol == nil {
			t.Errorf("--%s=%s: no volume is mounted (as a directory) at %s", flag, path, dir)
			continue
		}
		var source string
		var items []keyPath
		switch {
		case vol.Secret != nil:
			source, items = vol.Secret.SecretName, vol.Secret.Items
		case vol.ConfigMap != nil:
			source, items = vol.ConfigMap.Name, vol.ConfigMap.Items
		}
		key := ""
		for _, it := range items {
			if it.Path == base {
				key = it.Key
			}
		}
		if key == "" && len(items) == 0 {
			key = base
		}
		if key == "" {
			t.Errorf("--%s=%s: volume %q does not project %s", flag, path, vol.Name, base)
			continue
		}
		if o, ok := rendered[source]; ok {
			content, ok := o.Data[key]
			if !ok {
				content, ok = o.StringData[key]
			}
			if !ok {
				t.Errorf("--%s=%s: %s %s has no key %s", flag, path, o.Kind, source, key)
			}
			if flag == "config" {
				configFile = content
			}
		}
	}

	// The config file the chart writes: tenants unless auth is off on
	// purpose, and accepted by the binary.
	if configFile != "" {
		var cfg struct{ Tenants []any }
		if err := yaml.Unmarshal([]byte(configFile), &cfg); err != nil {
			t.Errorf("the rendered config file: %v", err)
		}
		if _, insecure := args["insecure-allow-no-auth"]; len(cfg.Tenants) == 0 && !insecure {
			t.Error("the config file has no tenants and --insecure-allow-no-auth is not given: the binary would refuse to start")
		}
		checkConfigAccepted(t, bin, configFile)
	}

	// The database URL comes from a Secret.
	found := false
	for _, e := range c.Env {
		found = found || (e.Name == "DATABASE_URL" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil)
	}
	if !found {
		t.Error("DATABASE_URL is not taken from a Secret")
	}

	sc := c.SecurityContext
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532 ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		strings.Join(sc.Capabilities.Drop, ",") != "ALL" {
		t.Errorf("container securityContext = %+v, want non-root 65532, read-only root, no privilege escalation, drop ALL", sc)
	}

	for _, pdb := range byKind["PodDisruptionBudget"] {
		if !subset(pdb.Spec.Selector.MatchLabels, dep.Spec.Template.Metadata.Labels) {
			t.Errorf("the PodDisruptionBudget's selector %v does not select the pods", pdb.Spec.Selector.MatchLabels)
		}
	}
	for _, sm := range byKind["ServiceMonitor"] {
		if !subset(sm.Spec.Selector.MatchLabels, svc.Metadata.Labels) || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" {
			t.Errorf("the ServiceMonitor does not scrape the Service's http port: %+v", sm.Spec)
		}
	}
}

func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// checkConfigAccepted starts the binary with the config file and a database
// that is not there: a file it refuses ends it at once; one it accepts gets
// it as far as applying migrations (where it waits for the database).
func checkConfigAccepted(t *testing.T, bin, content string) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", path, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "DATABASE_URL=postgres://127.0.0.1:1/none?connect_timeout=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var log []string
	timeout := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Errorf("idemcoord refused the rendered config file:\n%s\n--- config.yaml ---\n%s", strings.Join(log, "\n"), content)
				return
			}
			log = append(log, l)
			if strings.Contains(l, "applying migrations") {
				return
			}
		case <-timeout:
			t.Errorf("idemcoord neither refused nor accepted the config file in 30s:\n%s", strings.Join(log, "\n"))
			return
		}
	}
}
