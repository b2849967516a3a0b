package tokenize

import "testing"

func TestTemplatesRender(t *testing.T) {
	msgs := []Message{{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}}
	cases := []struct {
		name   string
		genP   bool
		expect string
	}{
		{"chatml", false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
			"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"},
		{"chatml", true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
			"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"},
		{"llama3", true, "<|begin_of_text|>" +
			"<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama3", false, "<|begin_of_text|>" +
			"<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"},
		{"raw", true, "Be brief.HiHello!Bye"},
	}
	for _, c := range cases {
		tmpl, err := GetTemplate(c.name)
		if err != nil {
			t.Fatal(err)
		}
		if tmpl.Name() != c.name {
			t.Errorf("Name() = %q", tmpl.Name())
		}
		if got, err := Render(tmpl, msgs, c.genP); err != nil || got != c.expect {
			t.Errorf("%s gen=%v:\n got %q\nwant %q", c.name, c.genP, got, c.expect)
		}
	}
}
