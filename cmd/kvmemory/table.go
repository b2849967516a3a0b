package main

import (
	"fmt"
	"io"
	"strconv"
)

// writeTable prints the rows as the Markdown table BENCHMARKS.md keeps.
func writeTable(w io.Writer, o options, rows []row) {
	under := ""
	if o.gomemlimit != "" {
		under = ", GOMEMLIMIT=" + o.gomemlimit
	}
	fmt.Fprintf(w, "%d rounds of %d concurrent clients, answers of %d MiB%s\n\n", o.rounds, o.clients, o.answerMB, under)
	fmt.Fprintf(w, "| body_memory_mb | peak RSS | statuses (%d requests) |\n|---|---|---|\n", o.rounds*o.clients)
	for _, r := range rows {
		setting := r.budget
		if r.budget == "default" {
			setting = "default"
			if r.setting > 0 {
				setting += " (" + strconv.Itoa(r.setting) + ")"
			}
		}
		fmt.Fprintf(w, "| %s | %s MB | %s |\n", setting, thousands(r.peakRSS/1e6), r.statuses())
	}
}

// thousands is n with commas: 1,011.
func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
