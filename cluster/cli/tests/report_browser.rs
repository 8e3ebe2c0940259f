//! The HTML report rendered by a real headless browser (Chromium): the page opens, and
//! the screenshot shows both runs' colours in substantial amounts (lines and bars drawn,
//! not an empty page). Needs `chromium` (or the browser `LOCKSTEP_CHROMIUM` names), so
//! the test is `#[ignore]`d: `scripts/test.sh` runs it when the browser is installed and
//! reports it SKIPPED by name when it is not. Run that way without a browser, it fails.
//! `LOCKSTEP_REPORT_PNG=PATH` keeps the screenshot. docs/report.png is README's command
//! (the `ab` page of examples/ctx-only.toml) at the same window size, 1300 × 2400: a
//! one-server page's five rows of plots (a disaggregated page needs about 3400).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{agg_text, output_within, parse, simulate, temp};
use lockstep_plan::report::html::render;

fn browser() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_CHROMIUM") {
        return PathBuf::from(p);
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if found {
            return PathBuf::from(name);
        }
    }
    panic!("no headless browser: install chromium (scripts/test.sh does) or set LOCKSTEP_CHROMIUM");
}

/// Pixels within a small distance of `rgb`.
fn count_colour(pixels: &[u8], channels: usize, rgb: [u8; 3]) -> usize {
    pixels
        .chunks_exact(channels)
        .filter(|p| (0..3).all(|c| p[c].abs_diff(rgb[c]) <= 16))
        .count()
}

#[test]
#[ignore = "needs a headless Chromium; scripts/test.sh runs it when one is installed"]
fn the_ab_report_renders_in_headless_chromium() {
    let text = agg_text(4, true);
    let runs = vec![
        (
            "legacy".to_string(),
            simulate(&parse(&text, &["policy.preset=\"legacy\""])),
        ),
        ("fixed".to_string(), simulate(&parse(&text, &[]))),
    ];
    let html = temp("report.html");
    std::fs::write(&html, render(&runs)).unwrap();
    let png = temp("report.png");
    let profile = temp("chromium-profile");
    let mut cmd = Command::new(browser());
    cmd.args([
        "--headless",
        "--disable-gpu",
        "--no-sandbox",
        "--hide-scrollbars",
        "--window-size=1300,2400",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .arg(format!("--screenshot={}", png.display()))
    .arg(format!("file://{}", html.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let out = output_within(cmd, Duration::from_secs(90));
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::fs::File::open(&png).expect("chromium wrote the screenshot");
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("a frame");
    assert_eq!((info.width, info.height), (1300, 2400));
    let channels = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("unexpected colour type {other:?}"),
    };
    let pixels = &buf[..info.buffer_size()];
    // legacy (red) and fixed (blue): lines in five plots, bars in three.
    let red = count_colour(pixels, channels, [0xd6, 0x27, 0x28]);
    let blue = count_colour(pixels, channels, [0x1f, 0x77, 0xb4]);
    assert!(red > 20_000, "only {red} pixels of the legacy colour");
    assert!(blue > 20_000, "only {blue} pixels of the fixed colour");
    // Mostly a light page, not a blank or a black one.
    let white = count_colour(pixels, channels, [0xff, 0xff, 0xff]);
    assert!(white > pixels.len() / channels / 4, "{white} white pixels");
    if let Some(keep) = std::env::var_os("LOCKSTEP_REPORT_PNG") {
        std::fs::copy(&png, keep).unwrap();
    }
}
