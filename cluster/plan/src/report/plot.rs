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

/// Tick positions: about five round steps (1, 2 or 5 × 10^k) covering `[lo, hi]`, and
/// the step. An empty range (a constant series) gets a margin: 0 to 1 around zero,
/// ± half the value elsewhere, so no axis repeats one label.
fn ticks(lo: f64, hi: f64) -> (f64, f64, Vec<f64>, f64) {
    let (lo, hi) = if hi > lo && hi - lo > 1e-9 * lo.abs().max(hi.abs()) {
        (lo, hi)
    } else if lo == 0.0 {
        (0.0, 1.0)
    } else {
        let m = lo.abs() / 2.0;
        (lo - m, lo + m)
    };
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).floor();
    let last = (hi / step).ceil();
    let t: Vec<f64> = (0..=((last - first) as usize).min(50))
        .map(|i| (first + i as f64) * step)
        .collect();
    (first * step, last * step, t, step)
}

/// A tick's label, with as many decimals as the step needs (so ticks never share one),
/// trailing zeros dropped; thousands as `k` and millions as `M`.
fn label(v: f64, step: f64) -> String {
    let a = v.abs();
    if a < step * 1e-6 {
        return "0".into();
    }
    let (scale, suffix) = if a >= 1e6 {
        (1e6, "M")
    } else if a >= 1e4 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    let s = step / scale;
    let decimals = if s >= 1.0 {
        0
    } else {
        ((-s.log10() - 1e-9).ceil() as usize).min(12)
    };
    let mut t = format!("{:.*}", decimals, v / scale);
    if t.contains('.') {
        t = t.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    t.push_str(suffix);
    t
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

fn y_axis(o: &mut String, ys: &[f64], step: f64, sy: &dyn Fn(f64) -> f64) {
    for &v in ys {
        let py = sy(v);
        let _ = write!(
            o,
            r##"<line x1="{LEFT}" x2="{x2}" y1="{py:.1}" y2="{py:.1}" stroke="#e4e4e4"/><text x="{tx}" y="{ty:.1}" text-anchor="end" font-size="11">{l}</text>"##,
            x2 = W - RIGHT,
            tx = LEFT - 6.0,
            ty = py + 4.0,
            l = label(v, step),
        );
    }
    let _ = write!(
        o,
        r##"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{b}" stroke="#333"/><line x1="{LEFT}" x2="{r}" y1="{b}" y2="{b}" stroke="#333"/>"##,
        b = H - BOTTOM,
        r = W - RIGHT,
    );
}

/// The y axis: `y_range` when given (widened only if the data leave it), otherwise 0 to
/// the data's maximum (0 to 1 when every value is 0).
fn y_ticks(y_range: Option<(f64, f64)>, y_hi: f64) -> (f64, f64, Vec<f64>, f64) {
    match y_range {
        Some((a, b)) if y_hi <= b || y_hi.is_nan() => {
            let (_, _, t, step) = ticks(a, b);
            (a, b, t, step)
        }
        Some((a, _)) => ticks(a, y_hi),
        None => ticks(0.0, y_hi.max(0.0)),
    }
}

fn no_samples(o: &mut String) {
    let _ = write!(
        o,
        r##"<text x="{}" y="{}" text-anchor="middle" font-size="13" fill="#777">no samples</text></svg>"##,
        W / 2.0,
        H / 2.0
    );
}

/// A line plot; `y_range` fixes the y axis (e.g. 0..1 for a CDF), otherwise it spans
/// 0 to the data's maximum.
pub fn line_plot(axes: &Axes, series: &[Series], y_range: Option<(f64, f64)>) -> String {
    lines_and_dots(axes, series, &[], y_range)
}

/// Lines (`lines`, each a `<polyline class="series">`) over dots (`dots`, each a `<g
/// class="dots">` of circles): a scatter with, say, its front drawn through it. The
/// axes span 0 to the data's maximum unless `y_range` fixes y.
pub fn lines_and_dots(
    axes: &Axes,
    lines: &[Series],
    dots: &[Series],
    y_range: Option<(f64, f64)>,
) -> String {
    let series = lines;
    let mut o = String::new();
    frame(&mut o, axes, "line");
    let all = || lines.iter().chain(dots).flat_map(|s| s.points.iter());
    let (mut x_lo, mut x_hi) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut y_hi = f64::NEG_INFINITY;
    for &(x, y) in all() {
        x_lo = x_lo.min(x);
        x_hi = x_hi.max(x);
        y_hi = y_hi.max(y);
    }
    if !x_lo.is_finite() {
        no_samples(&mut o);
        return o;
    }
    let (x0, x1, xs, x_step) = ticks(x_lo.min(0.0), x_hi);
    let (y0, y1, ys, y_step) = y_ticks(y_range, y_hi);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let sy = |y: f64| H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM);
    y_axis(&mut o, &ys, y_step, &sy);
    for &v in &xs {
        let px = sx(v);
        let _ = write!(
            o,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{b}" y2="{b2}" stroke="#333"/><text x="{px:.1}" y="{ty}" text-anchor="middle" font-size="11">{l}</text>"##,
            b = H - BOTTOM,
            b2 = H - BOTTOM + 5.0,
            ty = H - BOTTOM + 18.0,
            l = label(v, x_step),
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
    for s in dots {
        let _ = write!(
            o,
            r#"<g class="dots" data-series="{n}" data-points="{k}" fill="{c}" fill-opacity="0.55">"#,
            n = escape(&s.name),
            k = s.points.len(),
            c = s.color,
        );
        for &(x, y) in &s.points {
            let _ = write!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5"/>"#,
                sx(x),
                sy(y)
            );
        }
        o.push_str("</g>");
    }
    let named: Vec<Series> = lines.iter().chain(dots).cloned().collect();
    legend(&mut o, &named);
    o.push_str("</svg>");
    o
}

/// Grouped bars: one group per category, one bar per series (`points` are
/// `(category index, value)`); `y_range` fixes the y axis (0..1 for a share, so every
/// server's bars compare), otherwise it spans 0 to the data's maximum.
pub fn bar_plot(
    axes: &Axes,
    categories: &[String],
    series: &[Series],
    y_range: Option<(f64, f64)>,
) -> String {
    let mut o = String::new();
    frame(&mut o, axes, "bar");
    if series.iter().all(|s| s.points.is_empty()) {
        no_samples(&mut o);
        return o;
    }
    let y_hi = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let (y0, y1, ys, y_step) = y_ticks(y_range, y_hi);
    let sy = |y: f64| H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM);
    y_axis(&mut o, &ys, y_step, &sy);
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
        let (a, b, t, _) = ticks(0.0, 87.0);
        assert_eq!((a, b), (0.0, 100.0));
        assert_eq!(t, vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let (_, b, _, _) = ticks(0.0, 0.93);
        assert!((b - 1.0).abs() < 1e-9);
    }

    fn labels(lo: f64, hi: f64) -> Vec<String> {
        let (_, _, t, step) = ticks(lo, hi);
        t.iter().map(|&v| label(v, step)).collect()
    }

    #[test]
    fn a_constant_range_gets_a_margin_and_labels_never_repeat() {
        // All zero: 0 to 1, not 0 to 1e-9 labelled "0.00" five times.
        assert_eq!(labels(0.0, 0.0), ["0", "0.2", "0.4", "0.6", "0.8", "1"]);
        // A constant elsewhere: ± half of it.
        let (a, b, _, _) = ticks(40.0, 40.0);
        assert!(a <= 20.0 && b >= 60.0 && a > 0.0, "{a}..{b}");
        for (lo, hi) in [
            (0.0, 0.0),
            (0.0, 1e-9),
            (0.0, 0.003),
            (0.0, 0.93),
            (0.0, 87.0),
            (0.0, 12_345.0),
            (10_000.0, 10_900.0),
            (0.0, 3.2e6),
            (7.0, 7.0),
        ] {
            let l = labels(lo, hi);
            let mut d = l.clone();
            d.dedup();
            assert_eq!(d, l, "{lo}..{hi}: repeated tick labels");
        }
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
