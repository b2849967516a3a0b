package bench

import (
	"encoding/csv"
	"io"
	"strconv"
	"time"
)

// RequestRecord is what one request measured, for per-request comparison of
// runs (kvbench -dump).
type RequestRecord struct {
	Index   int           // position in the workload
	Arrival time.Duration // scheduled arrival
	Sent    time.Duration // when it was actually sent (replay) or routed (sim)
	Worker  string        // engine that served it ("" if unknown)
	Prompt  int
	Cached  int // negative: the response did not say (an empty CSV field)
	Output  int
	TTFT    time.Duration
	Err     string
}

// DumpHeader is the CSV header WriteRecords writes.
const DumpHeader = "index,arrival_ms,sent_ms,worker,prompt,cached,output,ttft_ms,error"

// WriteRecords writes records as CSV under DumpHeader, times in milliseconds.
func WriteRecords(w io.Writer, recs []RequestRecord) error {
	cw := csv.NewWriter(w)
	if _, err := io.WriteString(w, DumpHeader+"\n"); err != nil {
		return err
	}
	msf := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 3, 64) }
	for _, r := range recs {
		cached := ""
		if r.Cached >= 0 {
			cached = strconv.Itoa(r.Cached)
		}
		cw.Write([]string{strconv.Itoa(r.Index), msf(r.Arrival), msf(r.Sent), r.Worker,
			strconv.Itoa(r.Prompt), cached, strconv.Itoa(r.Output), msf(r.TTFT), r.Err})
	}
	cw.Flush()
	return cw.Error()
}
