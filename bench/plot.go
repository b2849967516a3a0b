package bench

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// WriteCharts writes name-ttft-cdf.png (TTFT CDF per policy, log time axis)
// and name-hit-rate.png (hit rate per policy, with the ceiling when known)
// into dir. The titles show name as it is; the file names replace path
// separators in it with '_'.
func WriteCharts(dir, name string, rep *Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	file := chartFileName(name)
	if err := savePNG(filepath.Join(dir, file+"-ttft-cdf.png"), TTFTChart(name, rep)); err != nil {
		return err
	}
	return savePNG(filepath.Join(dir, file+"-hit-rate.png"), HitRateChart(name, rep))
}

// chartFileName makes a workload name (a -name or -label may hold a path)
// usable as one file name.
func chartFileName(name string) string {
	name = strings.Map(func(r rune) rune {
		if r == '/' || r == '\\' || r == os.PathSeparator {
			return '_'
		}
		return r
	}, name)
	if name == "" || name == "." || name == ".." {
		name = "_" + name
	}
	return name
}

func savePNG(path string, img image.Image) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
	{0xff, 0x7f, 0x0e, 0xff}, {0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff},
	{0xe3, 0x77, 0xc2, 0xff}, {0x17, 0xbe, 0xcf, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
}

// canvas is a white image with a plot area and helpers to draw on it.
type canvas struct {
	img                    *image.RGBA
	left, top, right, bott int // plot area in pixels
}

const chartW, chartH = 900, 560

func newCanvas() *canvas {
	c := &canvas{img: image.NewRGBA(image.Rect(0, 0, chartW, chartH)), left: 80, top: 56, right: chartW - 200, bott: chartH - 60}
	draw.Draw(c.img, c.img.Bounds(), image.White, image.Point{}, draw.Src)
	return c
}

func (c *canvas) text(x, y int, s string, col color.Color) {
	d := font.Drawer{Dst: c.img, Src: image.NewUniform(col), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func textWidth(s string) int { return 7 * len(s) }

func (c *canvas) dot(x, y int, col color.Color, w int) {
	for dx := 0; dx < w; dx++ {
		for dy := 0; dy < w; dy++ {
			c.img.Set(x+dx-w/2, y+dy-w/2, col)
		}
	}
}

// line draws from (x0,y0) to (x1,y1) w pixels wide (Bresenham); dashed
// lines skip every other 6 pixels.
func (c *canvas) line(x0, y0, x1, y1 int, col color.Color, w int, dashed bool) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	err := dx + dy
	for n := 0; ; n++ {
		if !dashed || (n/6)%2 == 0 {
			c.dot(x0, y0, col, w)
		}
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * err
		if e2 >= dy {
			err += dy
			x0 += sx
		}
		if e2 <= dx {
			err += dx
			y0 += sy
		}
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

func sign(x int) int {
	switch {
	case x > 0:
		return 1
	case x < 0:
		return -1
	}
	return 0
}

var (
	black = color.RGBA{0, 0, 0, 0xff}
	grid  = color.RGBA{0xdd, 0xdd, 0xdd, 0xff}
)

func (c *canvas) frame(title, xlabel, ylabel string) {
	c.text(c.left, 20, title, black)
	c.line(c.left, c.bott, c.right, c.bott, black, 1, false)
	c.line(c.left, c.top, c.left, c.bott, black, 1, false)
	c.text((c.left+c.right-textWidth(xlabel))/2, chartH-18, xlabel, black)
	c.text(8, c.top-12, ylabel, black)
}

func (c *canvas) legend(i int, label string, col color.Color) {
	x, y := c.right+20, c.top+10+i*20
	c.line(x, y, x+24, y, col, 3, false)
	c.text(x+32, y+4, label, black)
}

// TTFTChart draws the cumulative distribution of TTFT for every result, on
// a logarithmic time axis.
func TTFTChart(name string, rep *Report) image.Image {
	c := newCanvas()
	c.frame(name+": TTFT CDF per policy", "time to first token (log scale)", "fraction of requests")
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range rep.Results {
		if n := len(r.TTFTs); n > 0 {
			lo = math.Min(lo, float64(max(r.TTFTs[0], time.Millisecond)))
			hi = math.Max(hi, float64(r.TTFTs[n-1]))
		}
	}
	if math.IsInf(lo, 0) {
		return c.img
	}
	// Whole decades around the data.
	l0 := math.Floor(math.Log10(lo))
	l1 := math.Ceil(math.Log10(max(hi, lo*10)))
	xOf := func(ns float64) int {
		f := (math.Log10(max(ns, math.Pow(10, l0))) - l0) / (l1 - l0)
		return c.left + int(f*float64(c.right-c.left))
	}
	yOf := func(q float64) int { return c.bott - int(q*float64(c.bott-c.top)) }
	for q := 0.0; q <= 1.0001; q += 0.1 {
		y := yOf(q)
		c.line(c.left+1, y, c.right, y, grid, 1, false)
		s := fmt.Sprintf("%.1f", q)
		c.text(c.left-8-textWidth(s), y+4, s, black)
	}
	for e := l0; e <= l1; e++ {
		x := xOf(math.Pow(10, e))
		c.line(x, c.top, x, c.bott-1, grid, 1, false)
		s := durLabel(time.Duration(math.Pow(10, e)))
		c.text(x-textWidth(s)/2, c.bott+18, s, black)
	}
	for i, r := range rep.Results {
		col := palette[i%len(palette)]
		n := len(r.TTFTs)
		px, py := -1, -1
		for j, d := range r.TTFTs {
			x, y := xOf(float64(d)), yOf(float64(j+1)/float64(n))
			if px >= 0 && (x != px || y != py) {
				c.line(px, py, x, y, col, 2, false)
			}
			if px < 0 || x != px || y != py {
				px, py = x, y
			}
		}
		c.legend(i, r.Policy, col)
	}
	return c.img
}

func durLabel(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%gs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%gms", float64(d)/1e6)
	}
	return fmt.Sprintf("%gus", float64(d)/1e3)
}

// HitRateChart draws the hit rate of every result as a bar, with the
// ceiling (one LRU cache of the fleet's capacity) as a dashed line.
func HitRateChart(name string, rep *Report) image.Image {
	c := newCanvas()
	c.frame(name+": prefix-cache hit rate per policy", "policy", "cached / prompt tokens")
	top := 0.1
	for _, r := range rep.Results {
		if r.HitRate.Known() {
			top = math.Max(top, float64(r.HitRate))
		}
	}
	if rep.CeilingHitRate != nil {
		top = math.Max(top, *rep.CeilingHitRate)
	}
	top = math.Ceil(top*10) / 10
	yOf := func(v float64) int { return c.bott - int(v/top*float64(c.bott-c.top)) }
	for v := 0.0; v <= top+1e-9; v += 0.1 {
		y := yOf(v)
		c.line(c.left+1, y, c.right, y, grid, 1, false)
		s := fmt.Sprintf("%.1f", v)
		c.text(c.left-8-textWidth(s), y+4, s, black)
	}
	n := max(len(rep.Results), 1)
	slot := (c.right - c.left) / n
	for i, r := range rep.Results {
		col := palette[i%len(palette)]
		x0 := c.left + i*slot + slot/5
		x1 := c.left + (i+1)*slot - slot/5
		hit := 0.0 // an unknown rate: no bar, its label n/a
		if r.HitRate.Known() {
			hit = float64(r.HitRate)
		}
		draw.Draw(c.img, image.Rect(x0, yOf(hit), x1, c.bott), image.NewUniform(col), image.Point{}, draw.Src)
		v := r.HitRate.String()
		c.text((x0+x1-textWidth(v))/2, yOf(hit)-6, v, black)
		c.text((x0+x1-textWidth(r.Policy))/2, c.bott+18, r.Policy, black)
	}
	if rep.CeilingHitRate != nil {
		y := yOf(*rep.CeilingHitRate)
		c.line(c.left, y, c.right, y, black, 2, true)
		c.text(c.right+10, y+4, fmt.Sprintf("ceiling %.3f", *rep.CeilingHitRate), black)
	}
	return c.img
}
