package proxy

import (
	"strconv"
	"strings"

	"github.com/goccy/go-json"
)

// normalizeEngineError turns an engine's error answer into OpenAI's shape.
// Complete OpenAI-shaped bodies pass through, incomplete ones are filled in;
// older vLLM's flat
// {"object":"error","message","type","param","code"} and anything else
// (plain text, HTML from a load balancer) are wrapped.
func normalizeEngineError(status int, body []byte) []byte {
	var probe struct {
		Error   json.RawMessage `json:"error"`
		Object  string          `json:"object"`
		Message string          `json:"message"`
		Type    string          `json:"type"`
		Param   *string         `json:"param"`
		Code    json.RawMessage `json:"code"`
		Detail  json.RawMessage `json:"detail"`
	}
	if json.Unmarshal(body, &probe) == nil {
		if len(probe.Error) > 0 && probe.Error[0] == '{' {
			// OpenAI's shape. Passed on as it is when complete; filled in
			// when a member is missing, and a numeric code (vLLM sends the
			// status) is turned into the string OpenAI clients expect.
			var e struct {
				Message *string         `json:"message"`
				Type    *string         `json:"type"`
				Param   json.RawMessage `json:"param"`
				Code    json.RawMessage `json:"code"`
			}
			if json.Unmarshal(probe.Error, &e) != nil {
				return body
			}
			if e.Message != nil && e.Type != nil && len(e.Param) > 0 && len(e.Code) > 0 && (e.Code[0] == '"' || string(e.Code) == "null") {
				return body
			}
			msg, typ, param := "", defaultErrorType(status), ""
			if e.Message != nil {
				msg = *e.Message
			}
			if msg == "" {
				msg = "the engine answered with status " + strconv.Itoa(status)
			}
			if e.Type != nil && *e.Type != "" {
				typ = *e.Type
			}
			if len(e.Param) > 0 && e.Param[0] == '"' {
				json.Unmarshal(e.Param, &param)
			}
			return errorJSON(msg, typ, param, engineCode(status, msg, e.Code))
		}
		if probe.Message != "" {
			typ := probe.Type
			if typ == "" {
				typ = defaultErrorType(status)
			}
			param := ""
			if probe.Param != nil {
				param = *probe.Param
			}
			return errorJSON(probe.Message, typ, param, engineCode(status, probe.Message, probe.Code))
		}
		if len(probe.Detail) > 0 {
			return errorJSON("engine error: "+string(probe.Detail), defaultErrorType(status), "", "")
		}
	}
	msg := string(body)
	if len(msg) > 512 {
		msg = msg[:512]
	}
	if msg == "" {
		msg = "the engine answered with status " + strconv.Itoa(status)
	}
	return errorJSON(msg, defaultErrorType(status), "", "")
}

// engineCode is the code of an engine's error in OpenAI's terms. vLLM and
// SGLang give the status as the code; a prompt too long for the model then
// gets OpenAI's context_length_exceeded, which kvproxy's own check gives and
// clients test for (an agent compacts its conversation on it).
func engineCode(status int, msg string, raw json.RawMessage) string {
	code := codeString(raw)
	if status == 400 && (code == "" || code == "400") && exceedsContext(msg) {
		return "context_length_exceeded"
	}
	return code
}

// exceedsContext reports whether an engine's message says the prompt (with
// max_tokens) does not fit the model's context: vLLM's "This model's maximum
// context length is N tokens…" and "…is longer than the maximum model
// length…", SGLang's "…exceeds the maximum allowed length…".
func exceedsContext(msg string) bool {
	for _, s := range [...]string{"maximum context length", "longer than the maximum model length", "exceeds the maximum allowed length"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

func codeString(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

func defaultErrorType(status int) string {
	switch {
	case status == 400 || status == 404 || status == 422:
		return "invalid_request_error"
	case status == 429:
		return "rate_limit_error"
	case status >= 500:
		return "server_error"
	}
	return "upstream_error"
}

// engineMessage is the message of an engine's error answer, cut to 200 bytes.
func engineMessage(status int, body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	json.Unmarshal(normalizeEngineError(status, body), &e)
	m := e.Error.Message
	if len(m) > 200 {
		m = m[:200]
	}
	return m
}

// engineErrorKind describes an engine's error answer (normalized) for the
// log by its type, code and param, each cut to 64 bytes: " (type …, code
// …, param …)", or "" when it has none. Never its message: vLLM's can quote
// the request (VLLMValidationError appends "value=…", FastAPI's validation
// errors the input), and the log must not carry prompts.
func engineErrorKind(body []byte) string {
	var e struct {
		Error struct {
			Type  string          `json:"type"`
			Code  json.RawMessage `json:"code"`
			Param *string         `json:"param"`
		} `json:"error"`
	}
	json.Unmarshal(body, &e)
	var parts []string
	add := func(name, v string) {
		if v != "" {
			parts = append(parts, name+" "+cut(v, 64))
		}
	}
	add("type", e.Error.Type)
	add("code", codeString(e.Error.Code))
	if e.Error.Param != nil {
		add("param", *e.Error.Param)
	}
	if len(parts) == 0 {
		return ""
	}
	return " (" + strings.Join(parts, ", ") + ")"
}

func cut(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
