//go:build !race

package tokenize

const raceEnabled = false
