// Package e2e holds end-to-end tests: the kvproxy and kvmock binaries run as
// separate processes on loopback ports, and the client is the official
// OpenAI Go SDK or a raw socket.
package e2e
