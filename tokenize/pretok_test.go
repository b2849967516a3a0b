package tokenize

import (
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

var pretokenizers = []struct {
	name  string
	split func(string, int) int
	re    *regexp2.Regexp
}{
	{"cl100k_base", splitCL100K, regexp2.MustCompile(cl100kPattern, regexp2.None)},
	{"o200k_base", splitO200K, regexp2.MustCompile(o200kPattern, regexp2.None)},
	{"qwen", splitQwen, regexp2.MustCompile(qwenPattern, regexp2.None)},
	{"gpt2", splitGPT2, regexp2.MustCompile(gpt2Pattern, regexp2.None)},
}

func regexPieces(re *regexp2.Regexp, text string) []string {
	var out []string
	m, _ := re.FindStringMatch(text)
	for m != nil {
		out = append(out, m.String())
		m, _ = re.FindNextMatch(m)
	}
	return out
}

func splitPieces(split func(string, int) int, text string) []string {
	initClasses()
	var out []string
	for i := 0; i < len(text); {
		e := split(text, i)
		if e <= i {
			panic("pre-tokenizer made no progress")
		}
		out = append(out, text[i:e])
		i = e
	}
	return out
}

func comparePretokenizers(t *testing.T, text string) {
	t.Helper()
	if !utf8.ValidString(text) {
		text = string([]rune(text)) // as pkoukk: regexp2 works on runes
	}
	for _, p := range pretokenizers {
		want := regexPieces(p.re, text)
		got := splitPieces(p.split, text)
		if !slices.Equal(got, want) {
			for i := range min(len(got), len(want)) {
				if got[i] != want[i] {
					t.Fatalf("%s: %q\npiece %d: got %q, regex %q", p.name, text, i, got[i], want[i])
				}
			}
			t.Fatalf("%s: %q\ngot %d pieces %q\nregex %d pieces %q", p.name, text, len(got), got, len(want), want)
		}
	}
}

var pretokSeeds = []string{
	"", "hello world", "Hello, World! It's I'M we'LL they'Re you'VE she'd",
	"'s'S'tx'", "a   b", "a \t\n\n  b", "x\r\n\r\n  ", "  \n", "   ", "a ", " ", "\n",
	"1234567 12 3.14159", "١٢٣٤ ½ Ⅻ", "foo/bar\n/baz//\n\n", "}\n// x;\r\n/\n/", " ...!!\r\n", "(x)=>{return 42;}",
	"héllo wörld ÀÉÎ", "日本語のテキスト、句読点。", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم",
	"emoji 🙂🚀 👩‍👩‍👧 🇫🇷", "CamelCaseWordsHTTPServer", "ǅungla ǈ ǋ", "ʰʲ ˢ", "e\u0301\u0302 \u0301x a\u0301'S",
	"\u0301\u0301", ".\u0301", " \u0301", "\u00a0\u00a0x", "\u2028\u2029\u0085 \u3000y", "\v\f \v",
	"<|endoftext|><|im_start|>user\n", "ſ'ſ K'K İ'İ 'ſ", "x'\u017f", "\t\tfunc main() {\n\t\treturn\n\t}\n",
	"word\x80bytes\xff\xfe", strings.Repeat(" ", 300) + "x",
}

func TestPretokenizersMatchRegex(t *testing.T) {
	for _, s := range pretokSeeds {
		comparePretokenizers(t, s)
	}
	comparePretokenizers(t, longText(5000))
}

// TestPretokenizersEveryBMPRune checks the character classes: every rune of
// the Basic Multilingual Plane in several contexts.
func TestPretokenizersEveryBMPRune(t *testing.T) {
	if testing.Short() {
		t.Skip("slow")
	}
	contexts := []string{"a%c", " %c", "%cb", "%c%c", "'%c", "%c's", "A%cB", "1%c", "\n%c", ".%c", "%c "}
	step := rune(1)
	if raceEnabled { // no concurrency here; keep -race runs short with a sample
		step = 13
	}
	var b strings.Builder
	for r := rune(0); r < 1<<16; r += step {
		if r >= 0xd800 && r < 0xe000 {
			continue
		}
		for _, ctx := range contexts {
			b.WriteString(strings.ReplaceAll(ctx, "%c", string(r)))
			b.WriteByte(' ')
		}
		if b.Len() > 1<<12 {
			comparePretokenizers(t, b.String())
			b.Reset()
		}
	}
	comparePretokenizers(t, b.String())
}

func FuzzPretokenizers(f *testing.F) {
	for _, s := range pretokSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		comparePretokenizers(t, s)
	})
}
