package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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

// The files of replicas.creds_file and replicas.tls are read when the
// configuration is: a missing or wrong one is a configuration error
// naming its field, not a connection nats.go fails to make, and retries,
// for ever, once kvproxy has started.
func TestReplicasFilesAreChecked(t *testing.T) {
	dir := t.TempDir()
	notCreds := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(notCreds, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	creds := filepath.Join(dir, "kvproxy.creds")
	if err := os.WriteFile(creds, []byte("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\nSUAM\n------END USER NKEY SEED------\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	head := "models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}]\nreplicas: {nats: 'tls://h:4222', "
	for name, c := range map[string]struct{ yaml, field string }{
		"missing creds": {"creds_file: '" + filepath.Join(dir, "none.creds") + "'}", "replicas.creds_file"},
		"not creds":     {"creds_file: '" + notCreds + "'}", "replicas.creds_file"},
		"missing ca":    {"tls: {ca_file: '" + filepath.Join(dir, "none.pem") + "'}}", "replicas.tls.ca_file"},
		"ca not pem":    {"tls: {ca_file: '" + notCreds + "'}}", "replicas.tls.ca_file"},
		"cert alone":    {"tls: {cert_file: '" + notCreds + "'}}", "replicas.tls"},
		"bad key pair":  {"tls: {cert_file: '" + notCreds + "', key_file: '" + notCreds + "'}}", "replicas.tls"},
	} {
		_, err := Parse([]byte(head + c.yaml + "\n"))
		if err == nil || !strings.Contains(err.Error(), c.field+":") {
			t.Errorf("%s: want an error for %s, got %v", name, c.field, err)
		}
	}
	cfg, err := Parse([]byte(head + "creds_file: '" + creds + "'}\n"))
	if err != nil || cfg.Replicas.CredsFile != creds {
		t.Fatalf("a credentials file: %v", err)
	}
}
