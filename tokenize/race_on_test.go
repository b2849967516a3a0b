//go:build race

package tokenize

// raceEnabled: the race detector slows the regexp2 reference about tenfold.
const raceEnabled = true
