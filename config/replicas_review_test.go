package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// A negative replicas.interval is one error, not also "at least 10ms".
func TestNegativeReplicasIntervalOneError(t *testing.T) {
	_, err := Parse([]byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}]\nreplicas: {nats: 'nats://h:4222', interval: -1s}\n"))
	if err == nil || strings.Count(err.Error(), "replicas.interval") != 1 {
		t.Fatalf("want one replicas.interval error, got %v", err)
	}
}

// Above 20 s, peers (which cap a replica's interval there) would drop a
// live replica's load between its reports.
func TestReplicasIntervalAbove20sRefused(t *testing.T) {
	_, err := Parse([]byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}]\nreplicas: {nats: 'nats://h:4222', interval: 30s}\n"))
	if err == nil || !strings.Contains(err.Error(), "replicas.interval: must be between 10ms and 20s") {
		t.Fatalf("want a replicas.interval error, got %v", err)
	}
}

// creds mints a NATS user credentials file, its JWT's claims set by
// claims, its seed that of another user if otherSeed.
func creds(t *testing.T, claims func(*jwt.UserClaims), otherSeed bool) []byte {
	t.Helper()
	account, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	user, _ := nkeys.CreateUser()
	pub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(pub)
	if claims != nil {
		claims(uc)
	}
	token, err := uc.Encode(account)
	if err != nil {
		t.Fatal(err)
	}
	if otherSeed { // as nsc would never write it (FormatUserConfig refuses)
		other, _ := nkeys.CreateUser()
		seed, _ := other.Seed()
		return fmt.Appendf(nil, "-----BEGIN NATS USER JWT-----\n%s\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n%s\n------END USER NKEY SEED------\n", token, seed)
	}
	seed, _ := user.Seed()
	b, err := jwt.FormatUserConfig(token, seed)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The files of replicas.creds_file and replicas.tls are read when the
// configuration is: a missing or wrong one is a configuration error
// naming its field, not a connection nats.go fails to make, and retries,
// for ever, once kvproxy has started. Without replicas.nats they are not
// read (that is warned of).
func TestReplicasFilesAreChecked(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		f := filepath.Join(dir, name)
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}
	notCreds := write("notes.txt", []byte("hello"))
	good := write("good.creds", creds(t, nil, false))
	expired := write("expired.creds", creds(t, func(c *jwt.UserClaims) { c.Expires = time.Now().Add(-time.Hour).Unix() }, false))
	mismatched := write("mismatched.creds", creds(t, nil, true))
	undecorated := write("undecorated.creds", []byte(strings.Join(strings.Fields(
		strings.NewReplacer("-----BEGIN NATS USER JWT-----", "", "------END NATS USER JWT------", "",
			"-----BEGIN USER NKEY SEED-----", "", "------END USER NKEY SEED------", "").Replace(string(creds(t, nil, false)))), "\n")))
	early := write("early.creds", creds(t, func(c *jwt.UserClaims) { c.NotBefore = time.Now().Add(time.Hour).Unix() }, false))
	expiredDir := t.TempDir()
	testutil.SelfSignedCertValid(t, expiredDir, 1, time.Now().Add(-48*time.Hour), time.Now().Add(-time.Hour))
	expiredCert, expiredKey := filepath.Join(expiredDir, "cert.pem"), filepath.Join(expiredDir, "key.pem")
	garbled := write("garbled.creds", []byte("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\nSUAM\n------END USER NKEY SEED------\n"))
	head := "models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}]\nreplicas: {nats: 'tls://h:4222', "
	for name, c := range map[string]struct{ yaml, field, msg string }{
		"missing creds": {"creds_file: '" + filepath.Join(dir, "none.creds") + "'}", "replicas.creds_file", "no such file"},
		"not creds":     {"creds_file: '" + notCreds + "'}", "replicas.creds_file", "not a NATS user credentials file"},
		"garbled":       {"creds_file: '" + garbled + "'}", "replicas.creds_file", "not a NATS user credentials file"},
		"undecorated":   {"creds_file: '" + undecorated + "'}", "replicas.creds_file", "not a NATS user credentials file"},
		"expired":       {"creds_file: '" + expired + "'}", "replicas.creds_file", "expired at"},
		"another seed":  {"creds_file: '" + mismatched + "'}", "replicas.creds_file", "not its JWT's user's"},
		"not yet valid": {"creds_file: '" + early + "'}", "replicas.creds_file", "not valid until"},
		"expired cert":  {"tls: {cert_file: '" + expiredCert + "', key_file: '" + expiredKey + "'}}", "replicas.tls.cert_file", "expired at"},
		"missing ca":    {"tls: {ca_file: '" + filepath.Join(dir, "none.pem") + "'}}", "replicas.tls.ca_file", "no such file"},
		"ca not pem":    {"tls: {ca_file: '" + notCreds + "'}}", "replicas.tls.ca_file", "no PEM certificate"},
		"ca expired":    {"tls: {ca_file: '" + expiredCert + "'}}", "replicas.tls.ca_file", "every certificate in it expired"},
		"cert alone":    {"tls: {cert_file: '" + notCreds + "'}}", "replicas.tls", "go together"},
		"bad key pair":  {"tls: {cert_file: '" + notCreds + "', key_file: '" + notCreds + "'}}", "replicas.tls", "PEM"},
	} {
		_, err := Parse([]byte(head + c.yaml + "\n"))
		if err == nil || !strings.Contains(err.Error(), c.field+":") || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: want an error for %s saying %q, got %v", name, c.field, c.msg, err)
		}
	}
	cfg, err := Parse([]byte(head + "creds_file: '" + good + "'}\n"))
	if err != nil || cfg.Replicas.CredsFile != good {
		t.Fatalf("a credentials file: %v", err)
	}
	validDir := t.TempDir()
	testutil.SelfSignedCert(t, validDir, 1)
	if _, err := Parse([]byte(head + "tls: {ca_file: '" + filepath.Join(validDir, "cert.pem") + "'}}\n")); err != nil {
		t.Fatalf("a CA in force: %v", err)
	}
	// A path from the home directory, as a shell and nats.go read it.
	t.Setenv("HOME", dir)
	cfg, err = Parse([]byte(head + "creds_file: '~/good.creds', tls: {ca_file: '~/" + filepath.Base(notCreds) + "'}}\n"))
	if err == nil || !strings.Contains(err.Error(), "no PEM certificate in "+notCreds) || strings.Contains(err.Error(), "creds_file") {
		t.Fatalf("~/ paths: want only the CA file's error, naming %s: %v", notCreds, err)
	}
	// A bearer token's seed signs nothing the server checks: any will do.
	bearer := write("bearer.creds", creds(t, func(c *jwt.UserClaims) { c.BearerToken = true }, true))
	if _, err := Parse([]byte(head + "creds_file: '" + bearer + "'}\n")); err != nil {
		t.Fatalf("a bearer token: %v", err)
	}
	if _, err := Parse([]byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}]\nreplicas: {nats: '', creds_file: '" + notCreds + "'}\n")); err != nil {
		t.Fatalf("without nats: %v", err)
	}
}
