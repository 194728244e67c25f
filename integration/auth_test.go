package integration

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestAuthRoles runs natshard on a nats-server in operator mode, configured
// with the server.conf that shardctl auth init prints, and proves that
// each role does its job and that the server refuses it, visibly to the
// client, whatever it does outside its role (docs/SECURITY.md): a publisher
// subscribing to a shard, publishing on the control plane, writing KV or
// calling the admin API; a region of type "other" touching type kv; an
// admin writing KV or commanding regions. A forged command with a stale
// epoch, sent with region credentials, is refused by the region.
func TestAuthRoles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	ctlAuth(t, "auth", "init", "--dir", dir, "--types", "kv")
	ctlAuth(t, "auth", "user", "region", "region-other", "--dir", dir, "--types", "other")
	ctlAuth(t, "auth", "user", "admin", "admin-other", "--dir", dir, "--types", "other")
	ctlAuth(t, "auth", "user", "publisher", "publisher-other", "--dir", dir, "--types", "other")
	creds := func(name string) string { return filepath.Join(dir, name+".creds") }

	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	startProcess(t, "nats-server", "operator", "-c", filepath.Join(dir, auth.FileServerConf),
		"-a", "127.0.0.1", "-p", fmt.Sprint(port), "-sd", t.TempDir())
	kv := protocol.MustSubjects("", "", "kv")

	admin := dialAs(t, url, creds("admin"))
	common := []string{"--nats", url, "--rebalance-interval", "0", "--min-regions", "2"}
	web := fmt.Sprintf("127.0.0.1:%d", freePort(t)) // a's shard map, with region credentials
	procs := []*proc{
		startShardd(t, "a", append(common, "--creds", creds("region"), "--region", "a", "--type", "kv", "--http", web)...),
		startShardd(t, "b", append(common, "--creds", creds("region"), "--region", "b", "--type", "kv")...),
		// Type other delivers durably and remembers its entities: the
		// region role covers the message stream, the reminders and the
		// remembered entities.
		startShardd(t, "o", append(common, "--creds", creds("region-other"), "--region", "o", "--type", "other", "--min-regions", "1", "--delivery", "durable", "--remember")...),
	}
	st := waitSettled(t, admin.nc, kv, 60*time.Second, "a", "b")
	stOther := waitSettled(t, dialAs(t, url, creds("admin-other")).nc, protocol.MustSubjects("", "", "other"), 60*time.Second, "o")

	// The publisher does its job: requests to kv entities, answered.
	pub := dialAs(t, url, creds("publisher"))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	entity := kv.EntityOf("order-42", st.Shards)
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	defer rcancel()
	if out, err := kvRequest(rctx, pub.nc, entity, `{"op":"set","key":"n","value":1}`); err != nil || out["ok"] != true {
		t.Fatalf("publisher request: %v %v", out, err)
	}

	// A durable request to type other, as a publisher in any language
	// sends it (docs/PROTOCOL.md): a JetStream publish whose PubAck says
	// it is stored, the answer on the inbox in Natshard-Reply. It is
	// answered by o, and its entity remembered.
	otherPub := dialAs(t, url, creds("publisher-other"))
	inbox := nats.NewInbox()
	answers, err := otherPub.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(otherPub.nc)
	if err != nil {
		t.Fatal(err)
	}
	dm := nats.NewMsg(protocol.MustSubjects("", "", "other").EntityOf("order-7", stOther.Shards))
	dm.Data = []byte(`{"op":"set","key":"n","value":1}`)
	dm.Header.Set(protocol.HeaderReply, inbox)
	if _, err := js.PublishMsg(rctx, dm); err != nil {
		t.Fatalf("durable request to type other: the stream did not take it: %v", err)
	}
	if ans, err := answers.NextMsg(20 * time.Second); err != nil || !strings.Contains(string(ans.Data), `"ok":true`) {
		t.Fatalf("durable request to type other: %v %v", ans, err)
	}
	// And with natshard's Client on an admin's connection: its private
	// inbox gets the answer too.
	otherAdmin := dialAs(t, url, creds("admin-other"))
	if out, err := natshard.NewClient(otherAdmin.nc).Request(rctx, "other", "order-8", []byte(`{"op":"set","key":"n","value":2}`)); err != nil || !strings.Contains(string(out), `"ok":true`) {
		t.Fatalf("durable request to type other with the Client: %s %v", out, err)
	}
	if got := ctlAuth(t, "--nats", url, "--creds", creds("admin-other"), "--type", "other", "--json", "region", "o"); !strings.Contains(got, "order-7") {
		t.Errorf("region o's query does not list entity order-7:\n%s", got)
	}

	// The admin does its job: shardctl with admin credentials.
	for _, args := range [][]string{{"status"}, {"shards"}, {"stats"}, {"regions"}, {"locate", "order-42"}, {"region", "a"}, {"request", "order-42", `{"op":"get"}`}} {
		ctlAuth(t, append([]string{"--nats", url, "--creds", creds("admin")}, args...)...)
	}

	// A move under traffic: requests buffered while the shard is paused
	// are answered by the new owner after replay (regions write the buffer
	// stream, replay it and answer replayed requests).
	shard := protocol.ShardOf("order-42", st.Shards)
	to := map[string]string{"a": "b", "b": "a"}[owners(st)[shard]]
	// a's shard map follows it: the region role may watch the events.
	events, err := http.Get("http://" + web + "/ui/api/events?type=kv")
	if err != nil || events.StatusCode != http.StatusOK {
		t.Fatalf("the shard map's events: %v %v", err, events)
	}
	defer events.Body.Close()
	active := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(events.Body)
		for sc.Scan() {
			if strings.Contains(sc.Text(), fmt.Sprintf(`"shard":%d,"state":"active","region":%q`, shard, to)) {
				close(active)
				return
			}
		}
	}()
	var wg sync.WaitGroup
	var failed []error
	var mu sync.Mutex
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := kvRequest(rctx, pub.nc, entity, `{"op":"incr","key":"hits"}`)
			rcancel()
			if err != nil {
				mu.Lock()
				failed = append(failed, err)
				mu.Unlock()
			}
		}
	}()
	time.Sleep(200 * time.Millisecond)
	ctlAuth(t, "--nats", url, "--creds", creds("admin"), "move", fmt.Sprint(shard), to)
	natstest.Eventually(t, 30*time.Second, "the shard moved", func() error {
		st, err := status(admin.nc, kv)
		if err != nil {
			return err
		}
		if r := st.Table[shard]; r.Region != to || r.State != "active" {
			return fmt.Errorf("shard %d is %s on %s", shard, r.State, r.Region)
		}
		return nil
	})
	time.Sleep(200 * time.Millisecond)
	close(stop)
	wg.Wait()
	if len(failed) > 0 {
		t.Fatalf("%d requests failed during the move, first: %v", len(failed), failed[0])
	}
	select {
	case <-active:
	case <-time.After(20 * time.Second):
		t.Errorf("the shard map's event stream did not say that shard %d is active on %s", shard, to)
	}
	// And it may ask the coordinator's status and every region's query.
	resp, err := http.Get("http://" + web + "/ui/api/regions?type=kv")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || strings.Contains(string(body), `"error"`) || !strings.Contains(string(body), `"region":"b","answer"`) {
		t.Errorf("the shard map's regions with region credentials: %s %s", resp.Status, body)
	}

	// Outside their roles, the server refuses them.
	other := dialAs(t, url, creds("region-other"))
	refusals := []struct {
		who     *authConn
		what    string
		subject string
		do      func(nc *nats.Conn, subject string) error
	}{
		{pub, "publisher subscribes to a shard", kv.Shard(shard), subscribe},
		{pub, "publisher commands a region", kv.Region("a"), publish},
		{pub, "publisher writes KV", "$KV.natshard_kv.config", publish},
		{pub, "publisher writes the buffer", kv.Buffer(shard), publish},
		{pub, "publisher calls the admin API", kv.Admin(protocol.AdminStatus), request},
		{pub, "publisher reads the admin's replies", auth.InboxPrefix("admin") + ".>", subscribe},
		{pub, "publisher uses JetStream", "$JS.API.STREAM.INFO.KV_natshard_kv", request},
		{other, "region of type other subscribes to kv's data", kv.AllData(), subscribe},
		{other, "region of type other commands kv's regions", kv.Region("a"), publish},
		{other, "region of type other listens to kv's commands", kv.Region("a"), subscribe},
		{other, "region of type other writes kv's KV", "$KV.natshard_kv.config", publish},
		{other, "region of type other reads kv's bucket", "$JS.API.STREAM.MSG.GET.KV_natshard_kv", request},
		{other, "region of type other reads kv's buffer stream", "$JS.API.CONSUMER.CREATE.natshard_buf_kv", request},
		{other, "region of type other writes kv's buffer", kv.Buffer(shard), publish},
		{other, "region of type other calls kv's admin API", kv.Admin(protocol.AdminStatus), request},
		{admin, "admin writes KV", "$KV.natshard_kv.config", publish},
		{admin, "admin commands a region", kv.Region("a"), publish},
		{admin, "admin writes the buffer", kv.Buffer(shard), publish},
		{admin, "admin purges the buffer", "$JS.API.STREAM.PURGE.natshard_buf_kv", request},
		{admin, "admin deletes the bucket", "$JS.API.STREAM.DELETE.KV_natshard_kv", request},
		{admin, "admin subscribes to a shard", kv.Shard(shard), subscribe},
	}
	for _, r := range refusals {
		r.who.refused(t, r.what, r.subject, r.do)
	}
	// Anonymous clients are not let in at all.
	if nc, err := nats.Connect(url); err == nil {
		nc.Close()
		t.Errorf("an anonymous client connected to the server in operator mode")
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Errorf("anonymous connect: %v, want an authorization violation", err)
	}

	// A forged command with a stale epoch, sent with the credentials of a
	// region of the type (the only ones the server lets command regions),
	// is refused by the region, which keeps its shards.
	st = waitSettled(t, admin.nc, kv, 10*time.Second, "a", "b")
	region := dialAs(t, url, creds("region"))
	var inc string
	var held []int
	for _, r := range st.Regions {
		if r.ID == "a" {
			inc = r.Incarnation
		}
	}
	for _, s := range st.Table {
		if s.Region == "a" {
			held = append(held, s.Shard)
		}
	}
	forged, _ := protocol.Encode(protocol.Command{Kind: protocol.CmdDrop, Epoch: st.Coordinator.Epoch - 1, Coordinator: "b", Incarnation: inc, Shards: held})
	m, err := region.nc.Request(kv.Region("a"), forged, 5*time.Second)
	if err != nil {
		t.Fatalf("forged command: %v", err)
	}
	var reply protocol.Reply
	if err := protocol.Decode(m.Data, &reply); err != nil || !strings.Contains(reply.Error, "stale epoch") {
		t.Fatalf("forged command with epoch %d: reply %+v %v, want a stale epoch refusal", st.Coordinator.Epoch-1, reply, err)
	}
	// Nor does a newer epoch pass: it is not the coordinator lease's. (Had
	// it passed, the region would refuse the real coordinator's commands
	// as stale, and the coordinator would step down.)
	forged, _ = protocol.Encode(protocol.Command{Kind: protocol.CmdDrop, Epoch: st.Coordinator.Epoch + 1_000_000, Coordinator: "b", Incarnation: inc, Shards: held})
	if m, err = region.nc.Request(kv.Region("a"), forged, 5*time.Second); err != nil {
		t.Fatalf("forged command: %v", err)
	}
	reply = protocol.Reply{}
	if err := protocol.Decode(m.Data, &reply); err != nil || !strings.Contains(reply.Error, "not the coordinator lease's") || reply.Epoch >= st.Coordinator.Epoch+1_000_000 {
		t.Fatalf("forged command with a newer epoch: reply %+v %v, want a refusal", reply, err)
	}
	if out, err := kvRequest(ctx, pub.nc, kv.EntityOf("order-42", st.Shards), `{"op":"get","key":"n"}`); err != nil || fmt.Sprint(out["value"]) != "1" {
		t.Fatalf("entity after the refusals: %v %v", out, err)
	}
	if got := waitSettled(t, admin.nc, kv, 10*time.Second, "a", "b"); fmt.Sprint(owners(got)) != fmt.Sprint(owners(st)) {
		t.Fatalf("the table changed after the forged command: %v, was %v", owners(got), owners(st))
	}

	// Doing their jobs, shardd never stepped outside its permissions.
	for _, p := range procs {
		if log := p.log.String(); strings.Contains(strings.ToLower(log), "permissions violation") {
			t.Errorf("shardd %s hit a permissions violation:\n%s", p.name, grepLines(log, "ermissions"))
		}
	}
}

// TestAuthEmbedded: shardd --auth-dir runs its embedded server in operator
// mode and connects with the directory's region credentials; shardctl
// needs credentials to talk to it.
func TestAuthEmbedded(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	ctlAuth(t, "auth", "init", "--dir", dir)
	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	p := startShardd(t, "a", "--region", "a", "--auth-dir", dir, "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--data-dir", t.TempDir())
	admin := dialAs(t, url, filepath.Join(dir, "admin.creds"))
	waitSettled(t, admin.nc, protocol.MustSubjects("", "", "kv"), 60*time.Second, "a")
	out := ctlAuth(t, "--nats", url, "--creds", filepath.Join(dir, "admin.creds"), "request", "e-1", `{"op":"incr","key":"n"}`)
	if !strings.Contains(out, `"value":1`) {
		t.Fatalf("request through the secured embedded server: %s", out)
	}
	cmd := exec.Command(filepath.Join(binDir, "shardctl"), "--nats", url, "status")
	cmd.Env = append(os.Environ(), "NATS_CREDS=")
	if b, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(b), "--creds") {
		t.Fatalf("shardctl without credentials: %v\n%s", err, b)
	}
	if strings.Contains(strings.ToLower(p.log.String()), "permissions violation") {
		t.Errorf("shardd hit a permissions violation:\n%s", grepLines(p.log.String(), "ermissions"))
	}
}

// TestTLS: shardd's embedded server with --tls-cert, --tls-key and
// --tls-ca requires TLS and a client certificate signed by the CA;
// shardctl connects with --tls-ca, --tls-cert and --tls-key, and fails
// clearly without them.
func TestTLS(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := writeCert(t, dir, "ca", nil, nil)
	writeCert(t, dir, "server", ca, caKey)
	writeCert(t, dir, "client", ca, caKey)
	f := func(name string) string { return filepath.Join(dir, name) }
	port := freePort(t)
	url := fmt.Sprintf("tls://127.0.0.1:%d", port)
	startShardd(t, "a", "--region", "a", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--data-dir", t.TempDir(),
		"--tls-cert", f("server.pem"), "--tls-key", f("server.key"), "--tls-ca", f("ca.pem"))
	withCert := []string{"--nats", url, "--tls-ca", f("ca.pem"), "--tls-cert", f("client.pem"), "--tls-key", f("client.key")}
	var out []byte
	natstest.Eventually(t, 60*time.Second, "shardctl status over TLS", func() error {
		cmd := exec.Command(filepath.Join(binDir, "shardctl"), append(withCert, "request", "e-1", `{"op":"get"}`)...)
		var err error
		out, err = cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nats", url, "--tls-ca", f("ca.pem")}, "--tls-cert"},                                   // no client certificate
		{[]string{"--nats", url, "--tls-cert", f("client.pem"), "--tls-key", f("client.key")}, "--tls-ca"}, // server not trusted
		{[]string{"--nats", strings.Replace(url, "tls:", "nats:", 1)}, "--tls-ca"},                         // plain
	} {
		cmd := exec.Command(filepath.Join(binDir, "shardctl"), append(c.args, "status")...)
		if b, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(b), c.want) {
			t.Errorf("shardctl %v: %v\n%s, want a failure mentioning %q", c.args, err, b, c.want)
		}
	}
}

// writeCert writes <name>.pem and <name>.key in dir: a CA when parent is
// nil, otherwise a certificate for 127.0.0.1 signed by parent, good for
// servers and clients.
func writeCert(t *testing.T, dir, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "natshard test " + name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
	}
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
		parent, parentKey = tmpl, key
	} else {
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// ctlAuth runs shardctl and fails the test unless it exits 0.
func ctlAuth(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(binDir, "shardctl"), args...)
	cmd.Env = append(os.Environ(), "NATS_URL=", "NATS_CREDS=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("shardctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// authConn is a connection with some user's credentials that collects the
// asynchronous errors the server sends it.
type authConn struct {
	nc   *nats.Conn
	errs chan error
}

func dialAs(t *testing.T, url, creds string) *authConn {
	t.Helper()
	opts, err := auth.Client{Creds: creds}.Options()
	if err != nil {
		t.Fatal(err)
	}
	c := &authConn{errs: make(chan error, 64)}
	opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case c.errs <- err:
		default:
		}
	}))
	natstest.Eventually(t, 20*time.Second, "connect with "+filepath.Base(creds), func() error {
		c.nc, err = nats.Connect(url, opts...)
		return err
	})
	t.Cleanup(c.nc.Close)
	return c
}

// refused does something the user may not do and waits for the server's
// permissions violation naming subject.
func (c *authConn) refused(t *testing.T, what, subject string, do func(nc *nats.Conn, subject string) error) {
	t.Helper()
	for len(c.errs) > 0 {
		<-c.errs
	}
	_ = do(c.nc, subject)
	_ = c.nc.Flush()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case err := <-c.errs:
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), `"`+subject+`"`) {
				return
			}
		case <-timeout:
			t.Errorf("%s (%s): the server did not refuse it", what, subject)
			return
		}
	}
}

func subscribe(nc *nats.Conn, subject string) error {
	_, err := nc.SubscribeSync(subject)
	return err
}

func publish(nc *nats.Conn, subject string) error { return nc.Publish(subject, []byte("{}")) }

func request(nc *nats.Conn, subject string) error {
	_, err := nc.Request(subject, []byte("{}"), 300*time.Millisecond)
	return err
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
