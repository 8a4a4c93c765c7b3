package deploy

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The image test runs when IDEMCOORD_IMAGE names an image in buildah's
// local storage (`make image` builds one and runs this test on it), with
// the global buildah flags of BUILDAH_FLAGS. IDEMCOORD_IMAGE_VERSION and
// IDEMCOORD_IMAGE_COMMIT are what its labels and --version must say.

const imageBinary = "usr/local/bin/idemcoord"

// buildah runs buildah with BUILDAH_FLAGS and args and returns its stdout.
func buildah(t *testing.T, args ...string) []byte {
	t.Helper()
	flags := strings.Fields(os.Getenv("BUILDAH_FLAGS"))
	cmd := exec.Command("buildah", append(flags, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("buildah %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return out
}

// TestImage inspects the built image: its entrypoint, user, ports and OCI
// labels, and the binary in it, which must be static and answer --version
// with the version and commit of the labels.
func TestImage(t *testing.T) {
	image := os.Getenv("IDEMCOORD_IMAGE")
	if image == "" {
		t.Skip("IDEMCOORD_IMAGE is not set: `make image` builds the image and runs this test on it")
	}
	if _, err := exec.LookPath("buildah"); err != nil {
		t.Fatal("no buildah on PATH (Debian: apt-get install buildah)")
	}
	version, commit := os.Getenv("IDEMCOORD_IMAGE_VERSION"), os.Getenv("IDEMCOORD_IMAGE_COMMIT")

	var info struct {
		OCIv1 struct {
			Config struct {
				User         string
				Entrypoint   []string
				Env          []string
				ExposedPorts map[string]struct{}
				Labels       map[string]string
			} `json:"config"`
		}
	}
	if err := json.Unmarshal(buildah(t, "inspect", "--type", "image", image), &info); err != nil {
		t.Fatalf("buildah inspect: %v", err)
	}
	cfg := info.OCIv1.Config
	if strings.Join(cfg.Entrypoint, " ") != "/"+imageBinary {
		t.Errorf("entrypoint = %q, want [/%s]", cfg.Entrypoint, imageBinary)
	}
	if cfg.User != "65532:65532" {
		t.Errorf("user = %q, want 65532:65532", cfg.User)
	}
	for _, port := range []string{"50051/tcp", "9090/tcp"} {
		if _, ok := cfg.ExposedPorts[port]; !ok {
			t.Errorf("port %s is not exposed (exposed: %v)", port, cfg.ExposedPorts)
		}
	}
	for _, kv := range []string{"IDEMCOORD_LISTEN=0.0.0.0:50051", "IDEMCOORD_HTTP_LISTEN=0.0.0.0:9090"} {
		if !contains(cfg.Env, kv) {
			t.Errorf("environment %v lacks %s", cfg.Env, kv)
		}
	}
	for label, want := range map[string]string{
		"org.opencontainers.image.title":    "idemcoord",
		"org.opencontainers.image.version":  version,
		"org.opencontainers.image.revision": commit,
	} {
		if got := cfg.Labels[label]; got != want || got == "" {
			t.Errorf("label %s = %q, want %q", label, got, want)
		}
	}
	if cfg.Labels["org.opencontainers.image.created"] == "" {
		t.Error("no org.opencontainers.image.created label")
	}

	// The files of the image, read from its layers as pushed to an OCI
	// layout directory (no container runtime needed).
	dir := t.TempDir()
	buildah(t, "push", "--quiet", image, "oci:"+filepath.Join(dir, "oci"))
	files := imageFiles(t, filepath.Join(dir, "oci"))
	for _, name := range []string{imageBinary, "etc/ssl/certs/ca-certificates.crt", "etc/passwd", "etc/group"} {
		if _, ok := files[name]; !ok {
			t.Errorf("the image has no /%s", name)
		}
	}
	if !bytes.Contains(files["etc/ssl/certs/ca-certificates.crt"], []byte("-----BEGIN CERTIFICATE-----")) {
		t.Error("/etc/ssl/certs/ca-certificates.crt holds no PEM certificate")
	}
	if !bytes.Contains(files["etc/passwd"], []byte(":65532:65532:")) {
		t.Error("/etc/passwd has no entry for UID 65532")
	}
	bin := filepath.Join(dir, "idemcoord")
	if err := os.WriteFile(bin, files[imageBinary], 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatalf("the image's binary: %v", err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the image's binary is dynamically linked (it has a PT_INTERP program header): build it with CGO_ENABLED=0")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("the image's binary needs shared libraries %v", libs)
	}
	out, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("idemcoord --version: %v\n%s", err, out)
	}
	if want := "idemcoord " + version + " (commit " + commit + ")\n"; string(out) != want {
		t.Errorf("idemcoord --version = %q, want %q", out, want)
	}
}

func contains(list []string, s string) bool {
	return slices.Contains(list, s)
}

// imageFiles reads the regular files of the one image in the OCI layout
// directory dir, applying its layers in order.
func imageFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	type descriptor struct {
		MediaType string `json:"mediaType"`
		Digest    string `json:"digest"`
	}
	blob := func(d descriptor) []byte {
		algo, hex, ok := strings.Cut(d.Digest, ":")
		if !ok {
			t.Fatalf("bad digest %q", d.Digest)
		}
		data, err := os.ReadFile(filepath.Join(dir, "blobs", algo, hex))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	var index struct{ Manifests []descriptor }
	data, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("index.json: want one manifest (err %v): %s", err, data)
	}
	var manifest struct{ Layers []descriptor }
	if err := json.Unmarshal(blob(index.Manifests[0]), &manifest); err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	for _, layer := range manifest.Layers {
		var r io.Reader = bytes.NewReader(blob(layer))
		switch {
		case strings.HasSuffix(layer.MediaType, "+gzip") || strings.HasSuffix(layer.MediaType, ".gzip"):
			zr, err := gzip.NewReader(r)
			if err != nil {
				t.Fatal(err)
			}
			r = zr
		case strings.HasSuffix(layer.MediaType, "tar") || strings.HasSuffix(layer.MediaType, ".tar"):
		default:
			t.Fatalf("layer media type %s: not a tar or gzip tar", layer.MediaType)
		}
		tr := tar.NewReader(r)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			name := strings.TrimPrefix(filepath.Clean("/"+h.Name), "/")
			if h.Typeflag != tar.TypeReg {
				continue
			}
			if files[name], err = io.ReadAll(tr); err != nil {
				t.Fatal(err)
			}
		}
	}
	return files
}
