package proxy

import (
	"errors"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/kvproxy/kvproxy/backends"
)

// retryListener keeps serving through accept errors that pass: out of file
// descriptors (EMFILE, ENFILE), out of kernel memory (ENOBUFS, ENOMEM), a
// connection aborted before it was taken (ECONNABORTED), or any error the
// net package calls temporary or a timeout. Accept waits and tries again,
// 5 ms doubling to 1 s as net/http's Server does, while the connections
// wait in the kernel's backlog; serving resumes as soon as a descriptor is
// free. fasthttp's Serve returns on any such error but a timeout, and
// kvproxy exited with it: anyone who could reach the port could end it by
// opening connections up to the process's descriptor limit (found by the
// security review: ~1,017 idle connections under ulimit -n 1024).
type retryListener struct {
	net.Listener
	failed    func(err error, retryIn time.Duration) // each error retried
	recovered func(errors int, outage time.Duration) // the first accept after some
	done      chan struct{}                          // closed by Close: a wait ends at once
	closeOnce sync.Once
}

func newRetryListener(ln net.Listener, failed func(error, time.Duration), recovered func(int, time.Duration)) *retryListener {
	return &retryListener{Listener: ln, failed: failed, recovered: recovered, done: make(chan struct{})}
}

const (
	acceptRetryFirst = 5 * time.Millisecond
	acceptRetryMax   = time.Second
)

func (l *retryListener) Accept() (net.Conn, error) {
	var delay time.Duration
	var since time.Time
	failures := 0
	for {
		c, err := l.Listener.Accept()
		if err == nil {
			if failures > 0 {
				l.recovered(failures, time.Since(since))
			}
			return c, nil
		}
		if !temporaryAcceptError(err) {
			return nil, err
		}
		if failures == 0 {
			since = time.Now()
		}
		failures++
		if backends.OutOfFiles(err) && backends.ShedIdle() > 0 {
			// The engine connections the pools kept idle gave their
			// descriptors back: accept again at once.
			l.failed(err, 0)
			continue
		}
		delay = min(max(2*delay, acceptRetryFirst), acceptRetryMax)
		l.failed(err, delay)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-l.done: // closed: the next Accept says so
			t.Stop()
		}
	}
}

func (l *retryListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// temporaryAcceptError reports whether an accept error passes: the
// listener itself is fine and a later accept may succeed.
func temporaryAcceptError(err error) bool {
	if errors.Is(err, net.ErrClosed) {
		return false
	}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED} {
		if errors.Is(err, e) {
			return true
		}
	}
	var ne net.Error
	//lint:ignore SA1019 Temporary is what net/http's Server retries on too
	return errors.As(err, &ne) && (ne.Timeout() || ne.Temporary())
}

// acceptLog says what the accept loop goes through, in a line a second at
// most: a process out of descriptors fails every accept it tries.
type acceptLog struct {
	mu     sync.Mutex
	last   time.Time
	errors int // since the last line
}

// acceptFailed counts an accept error that passes and logs it, with those
// since the last line.
func (s *Server) acceptFailed(err error, retryIn time.Duration) {
	s.metrics.acceptErrors.Inc()
	l := &s.acceptLog
	l.mu.Lock()
	l.errors++
	now := time.Now()
	if now.Sub(l.last) < time.Second {
		l.mu.Unlock()
		return
	}
	n := l.errors
	l.errors, l.last = 0, now
	l.mu.Unlock()
	ev := s.log.Warn().Err(err).Int("errors", n).Str("retry_in", retryIn.String())
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		ev = ev.Str("hint", "out of file descriptors: lower limits.max_connections or raise the open files limit (ulimit -n, LimitNOFILE=)")
	}
	ev.Msg("accepting a connection failed; retrying, serving on")
}

// acceptRecovered logs the end of a run of accept errors.
func (s *Server) acceptRecovered(n int, outage time.Duration) {
	s.log.Info().Int("errors", n).Int64("outage_ms", outage.Milliseconds()).Msg("accepting connections again")
}
