package projects_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projects"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// demo is the demo service, served as NewGRPCServer wires it, in front of
// a real coordinator.
type demo struct {
	svc  *projects.Service
	idem *clients.Client
	api  projectsv1.ProjectsServiceClient
}

func startDemo(t *testing.T) *demo {
	t.Helper()
	// An auth-on coordinator, as in production: the service authenticates
	// with its tenant's token (clients.WithToken).
	const token = "demo-service-token"
	sum := sha256.Sum256([]byte(token))
	coord := coordtest.Start(t, coordtest.Options{Config: "tenants:\n  - { name: demo, token_sha256: " +
		hex.EncodeToString(sum[:]) + ", scopes: [\"*\"] }\n"})
	idem := clients.New(coord.Dial(t), clients.WithToken(token))
	svc := projects.NewService()
	srv := projects.NewGRPCServer(idem, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := idem.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return &demo{svc: svc, idem: idem, api: projectsv1.NewProjectsServiceClient(conn)}
}

func asUser(user string, kv ...string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), append([]string{projects.UserMetadataKey, user}, kv...)...)
}

// created calls CreateProject and returns the project and the
// idempotency-result header.
func (d *demo) create(t *testing.T, ctx context.Context, name, prompt string) (*projectsv1.Project, string) {
	t.Helper()
	var h metadata.MD
	resp, err := d.api.CreateProject(ctx, &projectsv1.CreateProjectRequest{Name: name, Prompt: prompt}, grpc.Header(&h))
	if err != nil {
		t.Fatalf("CreateProject(%q): %v", name, err)
	}
	var result string
	if v := h.Get(clients.ResultHeader); len(v) == 1 {
		result = v[0]
	}
	return resp.GetProject(), result
}

// The ghost-project story: a user whose "create" is retried three times,
// with the prompt reworded and the name typed differently, gets one
// project; another user with the same name gets their own.
func TestGhostProject(t *testing.T) {
	t.Parallel()
	d := startDemo(t)
	if clients.DedupKey("create-project", "u1", "", " Flower  Shop ") != clients.DedupKey("create-project", "u1", "", "flower shop") {
		t.Fatal("DedupKey tells the two spellings apart")
	}
	attempts := []struct{ name, prompt string }{
		{"Flower Shop", "a shop that sells flowers"},
		{" Flower  Shop ", "a small shop selling flowers and plants"},
		{"flower shop", "flowers!"},
	}
	var first *projectsv1.Project
	for i, a := range attempts {
		p, result := d.create(t, asUser("u1"), a.name, a.prompt)
		wantResult := "replayed"
		if i == 0 {
			first, wantResult = p, "created"
		}
		if result != wantResult || !proto.Equal(p, first) {
			t.Fatalf("retry %d: %v (%s), want %v (%s)", i, p, result, first, wantResult)
		}
	}
	if got := d.svc.Projects(); len(got) != 1 || got[0].GetPrompt() != attempts[0].prompt {
		t.Fatalf("projects after one user's retries: %v", got)
	}

	other, result := d.create(t, asUser("u2"), "Flower Shop", "my flower shop")
	if result != "created" || other.GetId() == first.GetId() || other.GetOwner() != "u2" {
		t.Fatalf("second user: %v (%s)", other, result)
	}
	if got := d.svc.Projects(); len(got) != 2 {
		t.Fatalf("projects after two users: %v", got)
	}

	// The record is found under the folded, deterministic key.
	key := clients.FoldPrincipal("u1", clients.DedupKey("create-project", "u1", "", "flower shop"))
	rec, err := d.idem.Lookup(context.Background(), &idempotencyv1.LookupRequest{
		Scope: "/projects.v1.ProjectsService/CreateProject", Key: key})
	if err != nil || rec.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("Lookup: %v, %v", rec, err)
	}

	// A client key still wins over the derived one: same key, other name.
	ctx := asUser("u1", clients.MetadataKey, "client-key-1")
	d.create(t, ctx, "Tea Room", "")
	_, err = d.api.CreateProject(ctx, &projectsv1.CreateProjectRequest{Name: "Coffee Room"})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("same client key, other name: %v, want FAILED_PRECONDITION", err)
	}
}

// Charge needs a client key; a declined charge is replayed as the same
// status; GetProject is never wrapped.
func TestChargeAndReads(t *testing.T) {
	t.Parallel()
	d := startDemo(t)
	req := &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: 2500, Currency: "EUR"}
	if _, err := d.api.Charge(asUser("u1"), req); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Charge without a key: %v, want INVALID_ARGUMENT", err)
	}
	ctx := asUser("u1", clients.MetadataKey, "charge-1")
	for range 2 {
		resp, err := d.api.Charge(ctx, req)
		if err != nil || resp.GetChargeId() != "ch_1" || resp.GetTotalCents() != 2500 {
			t.Fatalf("Charge: %v, %v", resp, err)
		}
	}
	big := &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: projects.DefaultLimitCents + 1, Currency: "EUR"}
	ctx = asUser("u1", clients.MetadataKey, "charge-2")
	var errs []*status.Status
	for range 2 {
		var h metadata.MD
		_, err := d.api.Charge(ctx, big, grpc.Header(&h))
		errs = append(errs, status.Convert(err))
	}
	if errs[0].Code() != codes.FailedPrecondition || !proto.Equal(errs[0].Proto(), errs[1].Proto()) {
		t.Fatalf("declined charge and its replay: %v / %v", errs[0].Proto(), errs[1].Proto())
	}

	p, _ := d.create(t, asUser("u1"), "Shop", "")
	for range 2 {
		var h metadata.MD
		got, err := d.api.GetProject(asUser("u1", clients.MetadataKey, "read"), &projectsv1.GetProjectRequest{Id: p.GetId()}, grpc.Header(&h))
		if err != nil || !proto.Equal(got.GetProject(), p) || len(h.Get(clients.ResultHeader)) != 0 {
			t.Fatalf("GetProject: %v, %v, header %v", got, err, h)
		}
	}
	if _, err := d.api.CreateProject(metadata.AppendToOutgoingContext(context.Background()),
		&projectsv1.CreateProjectRequest{Name: "x"}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("without a user: %v, want UNAUTHENTICATED", err)
	}
}

// The committed gen/ is what the pinned tools make of proto/ now.
func TestGeneratedCodeUpToDate(t *testing.T) {
	t.Parallel()
	bufBin, err := filepath.Abs("../../bin/buf")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(bufBin); err != nil {
		t.Skipf("pinned buf not installed (run `make tools`): %v", err)
	}
	out := t.TempDir()
	cmd := exec.Command(bufBin, "generate", "-o", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("buf generate: %v\n%s", err, b)
	}
	fresh := readTree(t, filepath.Join(out, "gen"))
	committed := readTree(t, "gen")
	for name, b := range fresh {
		if !bytes.Equal(committed[name], b) {
			t.Errorf("gen/%s is stale: regenerate with `cd examples/projects && ../../bin/buf generate` and commit it", name)
		}
	}
	for name := range committed {
		if _, ok := fresh[name]; !ok {
			t.Errorf("gen/%s is not generated from proto/ any more: delete it", name)
		}
	}
}

func readTree(t *testing.T, root string) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		rel, _ := filepath.Rel(root, path)
		files[filepath.ToSlash(rel)] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}
