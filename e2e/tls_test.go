package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// The OpenAI SDK talks to a kvproxy process serving HTTPS (tls in its
// config), trusting kvproxy's certificate: a whole answer and a stream.
func TestOpenAISDKOverTLS(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "20")
	dir := t.TempDir()
	cert := testutil.SelfSignedCert(t, dir, 1)
	listen := freePort(t)
	path := filepath.Join(dir, "kvproxy.yaml")
	body := "listen: " + listen + "\ntls: {cert_file: " + filepath.Join(dir, "cert.pem") + ", key_file: " + filepath.Join(dir, "key.pem") + "}\n" +
		backendsYAML(map[string]string{"m": engines[0]}, "")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "kvproxy", "-config", path)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	url := "https://" + listen
	waitFor(t, 15*time.Second, "kvproxy healthy over https:\n"+p.String(), func() bool {
		resp, err := hc.Get(url + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	c := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0), option.WithHTTPClient(hc))
	ctx := context.Background()
	res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "default", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Name a river.")}, MaxTokens: openai.Int(5),
	}, option.WithJSONSet("ignore_eos", true))
	if err != nil || len(res.Choices) != 1 || res.Usage.CompletionTokens != 5 {
		t.Fatalf("over TLS: %v %+v", err, res)
	}
	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model: "default", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Name a lake.")}, MaxTokens: openai.Int(8),
	}, option.WithJSONSet("ignore_eos", true))
	chunks := 0
	for stream.Next() {
		if len(stream.Current().Choices) > 0 && stream.Current().Choices[0].Delta.Content != "" {
			chunks++
		}
	}
	if err := stream.Err(); err != nil || chunks != 8 {
		t.Fatalf("stream over TLS: %d chunks, %v", chunks, err)
	}
}
