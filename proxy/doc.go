// Package proxy is kvproxy's HTTP face: the OpenAI endpoints, the request
// lifecycle (parse → tokenize → hash → route → forward → relay → free), the
// SSE relay, dry-run answers, admin and metrics endpoints.
//
// It owns no routing logic (package router), no tokenizer (package tokenize)
// and no engine connection handling (package backends); it wires them per
// request.
package proxy
