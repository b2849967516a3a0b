package proxy

import (
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// rejectLinesPerSec is how many access-log lines of rejected requests one
// tenant and reason may write in a second; the rest are summed up in one
// line when the second ends (the metrics count them all). A client
// hammering a limit wrote thousands of lines a second without it.
const rejectLinesPerSec = 10

// maxLimitedKeys bounds the tenant and reason pairs one second tracks;
// the reasons are kvproxy's own words, but a parse error's may vary.
const maxLimitedKeys = 256

// limitKey is a kind of line; warn: its lines are warnings (failures), and
// so is its summary.
type limitKey struct {
	tenant, reason string
	warn           bool
}

// logLimiter bounds the rate of similar log lines. A window opens at the
// first line after a quiet one and lasts window; its end writes a summary
// line for each key that went over.
type logLimiter struct {
	log    zerolog.Logger
	perKey int
	window time.Duration

	mu    sync.Mutex
	lines map[limitKey]int // in the current window; nil: none open
}

func newLogLimiter(log zerolog.Logger) *logLimiter {
	return &logLimiter{log: log, perKey: rejectLinesPerSec, window: time.Second}
}

// allow reports whether a line of tenant and reason (a warning or not)
// may be written now.
func (l *logLimiter) allow(tenant, reason string, warn bool) bool {
	k := limitKey{tenant, reason, warn}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lines == nil {
		l.lines = map[limitKey]int{}
		time.AfterFunc(l.window, l.endWindow)
	}
	n, seen := l.lines[k]
	if !seen && len(l.lines) >= maxLimitedKeys {
		k = limitKey{reason: "(other reasons)", warn: warn}
		n = l.lines[k]
	}
	l.lines[k] = n + 1
	return n < l.perKey
}

// endWindow writes a summary of what the window suppressed, and closes it.
func (l *logLimiter) endWindow() {
	l.mu.Lock()
	lines := l.lines
	l.lines = nil
	l.mu.Unlock()
	for k, n := range lines {
		if n > l.perKey {
			ev := l.log.Info()
			if k.warn {
				ev = l.log.Warn()
			}
			ev.Str("tenant", k.tenant).Str("error", k.reason).Int("suppressed", n-l.perKey).
				Dur("window", l.window).Msgf("suppressed %d similar lines", n-l.perKey)
		}
	}
}

// flush writes the open window's summary now (at exit, before its timer).
func (l *logLimiter) flush() { l.endWindow() }
