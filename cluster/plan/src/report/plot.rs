//! Inline SVG plots (lines and grouped bars) for the HTML report: axes with ticks and
//! units, a legend, nothing fetched from anywhere. Every series is one element with
//! `class="series"` (lines: a `<polyline>`, bars: a `<g>` of `<rect class="bar">`) and
//! its name in `data-series`, so tests can count them.

use std::fmt::Write;

const W: f64 = 620.0;
const H: f64 = 340.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 52.0;
const BOTTOM: f64 = 52.0;

/// One named series of `(x, y)` points (lines) or of values per category (bars).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// CSS colour.
    pub color: String,
    /// Points (lines) or `(category index, value)` (bars).
    pub points: Vec<(f64, f64)>,
}

/// A plot's title and axis labels (with units).
#[derive(Debug, Clone, PartialEq)]
pub struct Axes {
    /// Title.
    pub title: String,
    /// x axis label.
    pub x_label: String,
    /// y axis label.
    pub y_label: String,
}

/// Escapes text for HTML and SVG.
pub fn escape(text: &str) -> String {
    let mut o = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Tick positions: about five round steps (1, 2 or 5 × 10^k) covering `[lo, hi]`.
fn ticks(lo: f64, hi: f64) -> (f64, f64, Vec<f64>) {
    let (lo, hi) = if hi > lo { (lo, hi) } else { (lo, lo + 1.0) };
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let start = (lo / step).floor() * step;
    let end = (hi / step).ceil() * step;
    let mut t = Vec::new();
    let mut v = start;
    while v <= end + step * 1e-9 && t.len() < 50 {
        t.push(v);
        v += step;
    }
    (start, end, t)
}

fn label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || (v.fract() == 0.0 && a >= 1.0) {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn frame(o: &mut String, axes: &Axes, kind: &str) {
    let _ = write!(
        o,
        r##"<svg class="plot" data-kind="{kind}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{t}"><rect x="0" y="0" width="{W}" height="{H}" fill="#ffffff"/><text x="{cx}" y="20" text-anchor="middle" font-size="15" font-weight="bold">{t}</text><text x="{cx}" y="{xl}" text-anchor="middle" font-size="13">{x}</text><text transform="translate(16 {cy}) rotate(-90)" text-anchor="middle" font-size="13">{y}</text>"##,
        t = escape(&axes.title),
        cx = LEFT + (W - LEFT - RIGHT) / 2.0,
        xl = H - 10.0,
        cy = TOP + (H - TOP - BOTTOM) / 2.0,
        x = escape(&axes.x_label),
        y = escape(&axes.y_label),
    );
}

fn legend(o: &mut String, series: &[Series]) {
    // One row under the title, above the plot area: it never hides data.
    let mut x = LEFT;
    for s in series {
        let y = TOP - 12.0;
        let _ = write!(
            o,
            r#"<g class="legend"><rect x="{x}" y="{ry}" width="14" height="10" fill="{c}"/><text x="{tx}" y="{y}" font-size="12">{n}</text></g>"#,
            ry = y - 9.0,
            tx = x + 20.0,
            c = s.color,
            n = escape(&s.name),
        );
        x += 34.0 + 7.0 * s.name.chars().count() as f64;
    }
}

fn y_axis(o: &mut String, ys: &[f64], sy: &dyn Fn(f64) -> f64) {
    for &v in ys {
        let py = sy(v);
        let _ = write!(
            o,
            r##"<line x1="{LEFT}" x2="{x2}" y1="{py:.1}" y2="{py:.1}" stroke="#e4e4e4"/><text x="{tx}" y="{ty:.1}" text-anchor="end" font-size="11">{l}</text>"##,
            x2 = W - RIGHT,
            tx = LEFT - 6.0,
            ty = py + 4.0,
            l = label(v),
        );
    }
    let _ = write!(
        o,
        r##"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{b}" stroke="#333"/><line x1="{LEFT}" x2="{r}" y1="{b}" y2="{b}" stroke="#333"/>"##,
        b = H - BOTTOM,
        r = W - RIGHT,
    );
}

/// A line plot; `y_range` fixes the y axis (e.g. 0..1 for a CDF), otherwise it spans
/// 0 to the data's maximum.
pub fn line_plot(axes: &Axes, series: &[Series], y_range: Option<(f64, f64)>) -> String {
    let mut o = String::new();
    frame(&mut o, axes, "line");
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (mut x_lo, mut x_hi) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut y_hi = f64::NEG_INFINITY;
    for &(x, y) in all() {
        x_lo = x_lo.min(x);
        x_hi = x_hi.max(x);
        y_hi = y_hi.max(y);
    }
    if !x_lo.is_finite() {
        let _ = write!(
            o,
            r##"<text x="{}" y="{}" text-anchor="middle" font-size="13" fill="#777">no samples</text></svg>"##,
            W / 2.0,
            H / 2.0
        );
        return o;
    }
    let (x0, x1, xs) = ticks(x_lo.min(0.0), x_hi);
    let (y0, y1, ys) = match y_range {
        Some((a, b)) => (a, b, ticks(a, b).2),
        None => ticks(0.0, y_hi.max(1e-9)),
    };
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let sy = |y: f64| H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM);
    y_axis(&mut o, &ys, &sy);
    for &v in &xs {
        let px = sx(v);
        let _ = write!(
            o,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{b}" y2="{b2}" stroke="#333"/><text x="{px:.1}" y="{ty}" text-anchor="middle" font-size="11">{l}</text>"##,
            b = H - BOTTOM,
            b2 = H - BOTTOM + 5.0,
            ty = H - BOTTOM + 18.0,
            l = label(v),
        );
    }
    for s in series {
        let _ = write!(
            o,
            r#"<polyline class="series" data-series="{n}" data-points="{k}" fill="none" stroke="{c}" stroke-width="2.5" stroke-linejoin="round" points=""#,
            n = escape(&s.name),
            k = s.points.len(),
            c = s.color,
        );
        for &(x, y) in &s.points {
            let _ = write!(o, "{:.1},{:.1} ", sx(x), sy(y));
        }
        o.push_str("\"/>");
    }
    legend(&mut o, series);
    o.push_str("</svg>");
    o
}

/// Grouped bars: one group per category, one bar per series (`points` are
/// `(category index, value)`).
pub fn bar_plot(axes: &Axes, categories: &[String], series: &[Series]) -> String {
    let mut o = String::new();
    frame(&mut o, axes, "bar");
    let y_hi = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let (y0, y1, ys) = ticks(0.0, y_hi.max(1e-9));
    let sy = |y: f64| H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM);
    y_axis(&mut o, &ys, &sy);
    let n = categories.len().max(1) as f64;
    let group = (W - LEFT - RIGHT) / n;
    let bar = group * 0.8 / series.len().max(1) as f64;
    for (i, c) in categories.iter().enumerate() {
        let _ = write!(
            o,
            r#"<text x="{x:.1}" y="{y}" text-anchor="middle" font-size="11">{c}</text>"#,
            x = LEFT + group * (i as f64 + 0.5),
            y = H - BOTTOM + 18.0,
            c = escape(c),
        );
    }
    for (k, s) in series.iter().enumerate() {
        let _ = write!(
            o,
            r#"<g class="series" data-series="{n}" data-points="{p}" fill="{c}">"#,
            n = escape(&s.name),
            p = s.points.len(),
            c = s.color,
        );
        for &(i, v) in &s.points {
            let x = LEFT + group * (i + 0.1) + bar * k as f64;
            let top = sy(v);
            let _ = write!(
                o,
                r#"<rect class="bar" x="{x:.1}" y="{top:.1}" width="{w:.1}" height="{h:.1}"><title>{n}: {v:.3}</title></rect>"#,
                w = bar * 0.92,
                h = (H - BOTTOM - top).max(0.0),
                n = escape(&s.name),
            );
        }
        o.push_str("</g>");
    }
    legend(&mut o, series);
    o.push_str("</svg>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let (a, b, t) = ticks(0.0, 87.0);
        assert_eq!((a, b), (0.0, 100.0));
        assert_eq!(t, vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let (_, b, _) = ticks(0.0, 0.93);
        assert!((b - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_line_plot_has_one_polyline_per_series_with_its_points() {
        let s = |name: &str, n: usize| Series {
            name: name.into(),
            color: "#123456".into(),
            points: (0..n).map(|i| (i as f64, i as f64 * 2.0)).collect(),
        };
        let axes = Axes {
            title: "t <x>".into(),
            x_label: "x (ms)".into(),
            y_label: "y".into(),
        };
        let svg = line_plot(&axes, &[s("a", 5), s("b", 7)], None);
        assert_eq!(svg.matches("<polyline class=\"series\"").count(), 2);
        assert!(svg.contains("data-points=\"7\""));
        assert!(svg.contains("t &lt;x&gt;"));
        assert!(svg.contains("x (ms)"));
    }
}
