package replicas

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/internal/testutil"
	"github.com/kvproxy/kvproxy/router"
)

// shareThrough starts two replicas with cfg (URL, credentials, TLS) and
// checks that each gets the other's load.
func shareThrough(t *testing.T, cfg Config) {
	t.Helper()
	ka, kb := newSink(), newSink()
	for _, r := range []struct {
		id   string
		load Entry
		k    *sink
	}{
		{"a", Entry{Model: "m", Worker: "e0", Load: router.Load{Inflight: 3}}, ka},
		{"b", Entry{Model: "m", Worker: "e1", Load: router.Load{Inflight: 5}}, kb},
	} {
		c := cfg
		c.ID, c.Interval = r.id, 20*time.Millisecond
		s, err := Start(c, func() []Entry { return []Entry{r.load} }, r.k.apply, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
	}
	ka.waitFor(t, "b's load at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e1"}].Inflight == 5 })
	kb.waitFor(t, "a's load at b", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 3 })
}

// Replicas reach a NATS server whose certificate a private CA signed, and
// which asks for a client certificate (replicas.tls): before, only tls://
// with the system's CAs and no client certificate could be used.
func TestReplicasOverMutualTLS(t *testing.T) {
	dir := t.TempDir()
	testutil.SelfSignedCert(t, dir, 1) // the server's, and the CA the replicas trust
	ca, cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	clientDir := t.TempDir()
	testutil.SelfSignedCert(t, clientDir, 2) // the replicas' own, which the server trusts
	clientCert, clientKey := filepath.Join(clientDir, "cert.pem"), filepath.Join(clientDir, "key.pem")
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cert, KeyFile: key, CaFile: clientCert, Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	ns := startNATSWith(t, &server.Options{Port: -1, TLS: true, TLSVerify: true, TLSConfig: tc, TLSTimeout: 2})
	url := ns.ClientURL()
	// The server does require both: without the CA, or without a client
	// certificate, no connection.
	if nc, err := nats.Connect(url); err == nil {
		nc.Close()
		t.Fatal("connected without the CA")
	}
	if nc, err := nats.Connect(url, nats.RootCAs(ca)); err == nil {
		nc.Close()
		t.Fatal("connected without a client certificate")
	}
	shareThrough(t, Config{URL: url, Subject: "kvproxy.load", CAFile: ca, CertFile: clientCert, KeyFile: clientKey})
}

// Replicas reach a NATS server in operator mode with a user credentials
// file (replicas.creds_file), as Synadia Cloud's and nsc's servers want.
func TestReplicasWithCredentials(t *testing.T) {
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	operator, err := nkeys.CreateOperator()
	must(err)
	operatorPub, err := operator.PublicKey()
	must(err)
	operatorJWT, err := jwt.NewOperatorClaims(operatorPub).Encode(operator)
	must(err)
	operatorClaims, err := jwt.DecodeOperatorClaims(operatorJWT)
	must(err)
	account, err := nkeys.CreateAccount()
	must(err)
	accountPub, err := account.PublicKey()
	must(err)
	accountJWT, err := jwt.NewAccountClaims(accountPub).Encode(operator)
	must(err)
	user, err := nkeys.CreateUser()
	must(err)
	userPub, err := user.PublicKey()
	must(err)
	userSeed, err := user.Seed()
	must(err)
	userJWT, err := jwt.NewUserClaims(userPub).Encode(account)
	must(err)
	creds, err := jwt.FormatUserConfig(userJWT, userSeed)
	must(err)
	credsFile := filepath.Join(t.TempDir(), "kvproxy.creds")
	must(os.WriteFile(credsFile, creds, 0o600))

	resolver := &server.MemAccResolver{}
	must(resolver.Store(accountPub, accountJWT))
	ns := startNATSWith(t, &server.Options{Port: -1, TrustedOperators: []*jwt.OperatorClaims{operatorClaims}, AccountResolver: resolver})
	url := ns.ClientURL()
	if nc, err := nats.Connect(url); err == nil {
		nc.Close()
		t.Fatal("connected without credentials")
	}
	shareThrough(t, Config{URL: url, Subject: "kvproxy.load", CredsFile: credsFile})
}

// A server back with a certificate the replica does not trust (rotated to
// another CA, expired) is said, once a minute while it lasts: the log
// ended at "disconnected", the handshakes failing unsaid (the operator
// trial).
func TestUntrustedServerAfterADisconnectIsSaid(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	testutil.SelfSignedCert(t, dir, 1)
	testutil.SelfSignedCert(t, other, 2)
	serve := func(certDir string, port int) *server.Server {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: filepath.Join(certDir, "cert.pem"), KeyFile: filepath.Join(certDir, "key.pem")})
		if err != nil {
			t.Fatal(err)
		}
		return startNATSWith(t, &server.Options{Port: port, TLS: true, TLSConfig: tc, TLSTimeout: 2})
	}
	ns := serve(dir, -1)
	a, logs := startLogged(t, Config{URL: ns.ClientURL(), ID: "a", Interval: 10 * time.Millisecond, CAFile: filepath.Join(dir, "cert.pem")},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	if !a.Connected() {
		t.Fatalf("not connected: %s", logs.String())
	}
	port := ns.Addr().(*net.TCPAddr).Port
	ns.Shutdown()
	serve(other, port)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "replicas: cannot reconnect to NATS") {
		if time.Now().After(deadline) {
			t.Fatalf("the failed handshakes never said: %s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if l := logs.String(); strings.Count(l, "replicas: cannot reconnect to NATS") != 1 || !strings.Contains(l, "certificate") {
		t.Fatalf("log: %s", l)
	}
}
