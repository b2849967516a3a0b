package mockengine

import "time"

// PrefillMs is the time in milliseconds of a step that computes t uncached
// prompt tokens, from Dynamo's mocker fit:
// 4.209989e-7·t² + 0.01518344·t + 16.50142.
func PrefillMs(t int) float64 {
	x := float64(t)
	return 4.209989e-7*x*x + 0.01518344*x + 16.50142
}

// DecodeMs is the time in milliseconds of a decode step at KV usage fraction
// u (0..1), from Dynamo's mocker fit: −25.74u² + 54.01u + 5.74, at least 1 ms.
func DecodeMs(u float64) float64 {
	ms := -25.74*u*u + 54.01*u + 5.74
	if ms < 1 {
		ms = 1
	}
	return ms
}

// StepTime is the duration of one engine step that computes prefillTokens
// uncached prompt tokens and decodes decodeSeqs sequences at KV usage u.
//
// A mixed step costs the sum of its prefill and decode parts: the fits were
// measured on pure prefill and pure decode batches and each carries its own
// fixed overhead, so the sum errs on the slow side, as a chunked-prefill
// step that stalls decodes does. A step with neither takes no time.
func StepTime(prefillTokens, decodeSeqs int, u float64) time.Duration {
	ms := 0.0
	if prefillTokens > 0 {
		ms += PrefillMs(prefillTokens)
	}
	if decodeSeqs > 0 {
		ms += DecodeMs(u)
	}
	return time.Duration(ms * float64(time.Millisecond))
}
