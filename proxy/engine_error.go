package proxy

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/goccy/go-json"
)

// normalizeEngineError turns an engine's error answer into OpenAI's shape.
// Complete OpenAI-shaped bodies pass through, incomplete ones are filled in;
// older vLLM's flat
// {"object":"error","message","type","param","code"} and anything else
// (plain text, HTML from a load balancer) are wrapped. vLLM's and SGLang's
// type (a Python exception's name, "BadRequestError") and code (the
// status) become OpenAI's: the type its status's ("invalid_request_error")
// and no code, or context_length_exceeded; clients test both, and kvproxy's
// own errors have them so.
func normalizeEngineError(status int, body []byte) []byte {
	var probe struct {
		Error   json.RawMessage `json:"error"`
		Object  string          `json:"object"`
		Message string          `json:"message"`
		Type    string          `json:"type"`
		Param   *string         `json:"param"`
		Code    json.RawMessage `json:"code"`
		Detail  json.RawMessage `json:"detail"`
		// TGI's error names its kind here, its message being "error".
		ErrorType string `json:"error_type"`
	}
	if json.Unmarshal(body, &probe) == nil {
		if len(probe.Error) > 0 && probe.Error[0] == '"' && probe.Message == "" {
			// TGI's shape: {"error": "...", "error_type": "validation"}
			// (Ollama's too, without the type). Gateways that put the
			// reason phrase in "error" give the words in "message": read
			// below. A validation error is the request's fault, streamed
			// (its frame is passed as a 500) or not (TGI's 422): typed as
			// a 400, and a prompt too long as context_length_exceeded.
			var msg string
			json.Unmarshal(probe.Error, &msg)
			if probe.ErrorType == "validation" {
				status = 400
			}
			if msg == "" {
				msg = "the engine answered with status " + strconv.Itoa(status)
			}
			return engineErrorJSON(status, msg, "", "", nil)
		}
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
			// A member of another type (a message that is a list, a
			// numeric type) fails the decoding, the members before it
			// read: rebuilt from those, as no OpenAI client reads it as
			// it is (the fuzzing trial).
			mistyped := json.Unmarshal(probe.Error, &e) != nil
			if !mistyped && e.Message != nil && e.Type != nil && openAIType(*e.Type) && len(e.Param) > 0 && len(e.Code) > 0 && (e.Code[0] == '"' || string(e.Code) == "null") {
				return body
			}
			msg, typ, param := "", "", ""
			if e.Message != nil {
				msg = *e.Message
			}
			if msg == "" {
				msg = "the engine answered with status " + strconv.Itoa(status)
			}
			if e.Type != nil {
				typ = *e.Type
			}
			if len(e.Param) > 0 && e.Param[0] == '"' {
				json.Unmarshal(e.Param, &param)
			}
			return engineErrorJSON(status, msg, typ, param, e.Code)
		}
		if probe.Message != "" {
			param := ""
			if probe.Param != nil {
				param = *probe.Param
			}
			return engineErrorJSON(status, probe.Message, probe.Type, param, probe.Code)
		}
		if len(probe.Detail) > 0 {
			return errorJSON("engine error: "+string(probe.Detail), defaultErrorType(status), "", "")
		}
	}
	return errorJSON(plainErrorMessage(status, body), defaultErrorType(status), "", "")
}

// plainErrorMessage is the message of an engine's error answer that is no
// JSON: its text, up to 512 bytes (cut between characters); not a page (a
// gateway's HTML, which named its upstream's address to the client: the
// chaos trial) nor bytes that are no text.
func plainErrorMessage(status int, body []byte) string {
	msg := strings.TrimSpace(string(body))
	if len(msg) > 512 {
		cut := 512
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg = msg[:cut]
	}
	what := ""
	switch {
	case msg == "":
	case msg[0] == '<':
		what = " and a page"
	case !utf8.ValidString(msg) || strings.ContainsFunc(msg, func(r rune) bool { return unicode.IsControl(r) && r != '\n' && r != '\t' && r != '\r' }):
		what = " and bytes that are no text"
	default:
		return msg
	}
	return "the engine answered with status " + strconv.Itoa(status) + what
}

// engineErrorJSON is an engine's error in OpenAI's terms. vLLM and SGLang
// give the status as the code (in a stream's error frame, the only word of
// it): it sets the type, and is no code of OpenAI's. A prompt too long for
// the model gets OpenAI's context_length_exceeded, which kvproxy's own
// check gives and clients test for (an agent compacts its conversation on
// it). A type that is not OpenAI's (a Python exception's name) is the
// status's.
func engineErrorJSON(status int, msg, typ, param string, raw json.RawMessage) []byte {
	code := codeString(raw)
	if n, err := strconv.Atoi(code); err == nil {
		if n >= 400 && n <= 599 {
			status = n
		}
		code = ""
	}
	if status == 400 && code == "" && exceedsContext(msg) && !asksMoreThanContext(msg) {
		code = "context_length_exceeded"
	}
	if !openAIType(typ) {
		typ = defaultErrorType(status)
	}
	return errorJSON(msg, typ, param, code)
}

// openAIType reports whether an error type is in OpenAI's style: a
// snake_case word ("invalid_request_error"), not a class name.
func openAIType(typ string) bool {
	if typ == "" {
		return false
	}
	for i := 0; i < len(typ); i++ {
		if c := typ[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// exceedsContext reports whether an engine's message says the prompt (with
// max_tokens) does not fit the model's context: vLLM's "This model's maximum
// context length is N tokens…" and "…is longer than the maximum model
// length…", SGLang's "…exceeds the maximum allowed length…", TGI's
// "`inputs` tokens + `max_new_tokens` must be <= N" and "`inputs` must have
// less than N tokens".
func exceedsContext(msg string) bool {
	for _, s := range [...]string{"maximum context length", "longer than the maximum model length", "exceeds the maximum allowed length",
		"`inputs` tokens + `max_new_tokens` must be <=", "`inputs` must have less than"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// asksMoreThanContext reports whether an engine's context error is about
// max_tokens alone: more output asked for than the whole context holds,
// which no shorter prompt mends, so it is no context_length_exceeded (an
// agent would compact its conversation on that code and fail again).
// vLLM's "'max_tokens' or 'max_completion_tokens' is too large: N. This
// model's maximum context length is M tokens …" (before mid-2025: "This
// model's maximum context length is M tokens. However, you requested T
// tokens (P in the messages, N in the completion)"), SGLang's "…maximum
// context length of M tokens. You requested a total of T tokens: P tokens
// from the input messages and N tokens for the completion", TGI's
// "`inputs` tokens + `max_new_tokens` must be <= M. Given: P `inputs`
// tokens and N `max_new_tokens`".
func asksMoreThanContext(msg string) bool {
	limit := intAfterText(msg, "maximum context length is ")
	if limit < 0 {
		limit = intAfterText(msg, "maximum context length of ")
	}
	if limit < 0 {
		limit = intAfterText(msg, "`max_new_tokens` must be <= ")
	}
	asked := intAfterText(msg, "is too large: ")
	for _, end := range [...]string{" in the completion)", " tokens for the completion", " `max_new_tokens`"} {
		if asked < 0 {
			asked = intBeforeText(msg, end)
		}
	}
	return asked >= 0 && limit >= 0 && asked >= limit
}

// intAfterText is the number right after the first text in msg; -1 when
// there is none.
func intAfterText(msg, text string) int {
	if _, rest, ok := strings.Cut(msg, text); ok {
		return leadingInt(rest)
	}
	return -1
}

// intBeforeText is the number right before the last text in msg; -1 when
// there is none.
func intBeforeText(msg, text string) int {
	at := strings.LastIndex(msg, text)
	if at < 0 {
		return -1
	}
	before := msg[:at]
	i := len(before)
	for i > 0 && i > len(before)-12 && before[i-1] >= '0' && before[i-1] <= '9' {
		i--
	}
	return leadingInt(before[i:])
}

// leadingInt is the decimal number s starts with; -1 when none.
func leadingInt(s string) int {
	n, i := 0, 0
	for ; i < len(s) && i < 12 && s[i] >= '0' && s[i] <= '9'; i++ {
		n = n*10 + int(s[i]-'0')
	}
	if i == 0 {
		return -1
	}
	return n
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

// refusesConfig reports whether an engine's status refuses kvproxy's own
// configuration (its key: 401, 403; its url: a redirect), not the client's
// request.
func refusesConfig(status int) bool {
	return status == 401 || status == 403 || status >= 300 && status < 400
}

// configRefusal is what the client of a 502 and the log are told of an
// engine's refusesConfig answer (body, as it came) from backend id.
func configRefusal(id string, status int, body []byte) string {
	what, hint := "refused kvproxy's credentials", "check its api_key"
	if status < 400 {
		what, hint, body = "answered with a redirect", "check its url", nil
	}
	return "backend " + id + " " + what + " (" + refusalDetail(status, body) + "); " + hint
}

// refusalDetail tells an engine's refusal by its status, type, code and
// param, never its message: an engine may quote the request in it, the
// prompt or kvproxy's key with it (the SRE trial's engine echoed its
// Authorization header).
func refusalDetail(status int, body []byte) string {
	detail := strconv.Itoa(status)
	if w := errorKindWords(body); w != "" {
		detail += ": " + w
	}
	return detail
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
	if w := errorKindWords(body); w != "" {
		return " (" + w + ")"
	}
	return ""
}

// errorKindWords is engineErrorKind without its parentheses: "type …,
// code …, param …", or "".
func errorKindWords(body []byte) string {
	type kind struct {
		Type  string          `json:"type"`
		Code  json.RawMessage `json:"code"`
		Param *string         `json:"param"`
	}
	var e struct {
		Error *kind `json:"error"`
		kind        // older vLLM's flat {"object":"error",...}
	}
	json.Unmarshal(body, &e)
	k := e.kind
	if e.Error != nil {
		k = *e.Error
	}
	var parts []string
	add := func(name, v string) {
		if v != "" {
			parts = append(parts, name+" "+cut(v, 64))
		}
	}
	add("type", k.Type)
	add("code", codeString(k.Code))
	if k.Param != nil {
		add("param", *k.Param)
	}
	return strings.Join(parts, ", ")
}

func cut(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// errorMessage is the message of an error in OpenAI's shape (a
// normalized one); ok is false when errJSON is not JSON.
func errorMessage(errJSON []byte) (msg string, ok bool) {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	err := json.Unmarshal(errJSON, &e)
	return e.Error.Message, err == nil
}
