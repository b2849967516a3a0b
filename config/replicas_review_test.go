package config

import (
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
