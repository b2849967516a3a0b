//go:build race

package proxy

// raceEnabled: the race detector drops a quarter of what sync.Pool is given
// and allocates for itself; allocation bounds loosen under it.
const raceEnabled = true
