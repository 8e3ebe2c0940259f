//! Trace readers: Mooncake JSON Lines and the Azure LLM inference CSV, as documented in
//! `data/traces/README.md`. Both are parsed whole at load so a bad line fails the run
//! before it starts; errors carry the 1-based line number and name the field and value.

use std::path::Path;

use lockstep_actors::kv::mix;
use serde_json::Value;

use super::WorkloadError;
use super::config::{TraceConfig, TraceFormat};

/// One replayed request, before it gets an id.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TraceRecord {
    /// Arrival, already scaled by `time_scale`.
    pub at_ns: u64,
    pub prompt_len: u32,
    pub output_len: u32,
    /// Mooncake prefix block ids (one per `block_tokens` tokens); empty for Azure. Kept
    /// compact and expanded into KV block hashes only when the request is issued.
    pub hash_ids: Vec<u64>,
}

/// Reads and parses the trace, keeping at most `limit` records.
pub(crate) fn load(
    cfg: &TraceConfig,
    base_dir: &Path,
    limit: Option<u64>,
) -> Result<Vec<TraceRecord>, WorkloadError> {
    let path = if Path::new(&cfg.path).is_absolute() {
        Path::new(&cfg.path).to_path_buf()
    } else {
        base_dir.join(&cfg.path)
    };
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| WorkloadError::TraceRead {
        path: shown.clone(),
        source,
    })?;
    let limit = limit.unwrap_or(u64::MAX).saturating_add(cfg.skip);
    let mut records = match cfg.format {
        TraceFormat::Mooncake => {
            parse_mooncake(&text, &shown, cfg.time_scale, cfg.block_tokens(), limit)
        }
        TraceFormat::Azure => parse_azure(&text, &shown, cfg.time_scale, limit),
    }?;
    if cfg.skip > 0 {
        if cfg.skip >= records.len() as u64 {
            return Err(WorkloadError::Invalid {
                field: "workload.trace.skip",
                message: format!(
                    "= {} passes over every record: `{shown}` has {}",
                    cfg.skip,
                    records.len()
                ),
            });
        }
        records.drain(..cfg.skip as usize);
        let start = records[0].at_ns;
        for r in &mut records {
            r.at_ns -= start;
        }
    }
    Ok(records)
}

/// What a trace holds, read before it is replayed: how many records, over how long, and
/// the range of their lengths (`lockstep search` sizes its loads and bounds from it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceSummary {
    /// Records read (at most the limit asked for).
    pub records: u64,
    /// Seconds from the first record's arrival to the last one's, at `time_scale` 1.
    pub span_s: f64,
    /// The shortest and the longest prompt, tokens.
    pub prompt_len: (u32, u32),
    /// The shortest and the longest output, tokens.
    pub output_len: (u32, u32),
}

impl TraceSummary {
    /// Mean arrivals per second at `time_scale` 1: the gaps between records averaged
    /// (`None` when fewer than two records or all arrive at once).
    pub fn arrival_rate(&self) -> Option<f64> {
        (self.records >= 2 && self.span_s > 0.0).then(|| (self.records - 1) as f64 / self.span_s)
    }
}

/// Reads the first `limit` records of a trace (every one when `None`) as [`load`] does,
/// with the same errors, and summarises them.
pub fn summarize(
    cfg: &TraceConfig,
    base_dir: &Path,
    limit: Option<u64>,
) -> Result<TraceSummary, WorkloadError> {
    let unscaled = TraceConfig {
        time_scale: 1.0,
        ..cfg.clone()
    };
    let records = load(&unscaled, base_dir, limit)?;
    let range = |f: fn(&TraceRecord) -> u32| {
        records
            .iter()
            .map(f)
            .fold((u32::MAX, 0), |(lo, hi), v| (lo.min(v), hi.max(v)))
    };
    let first = records.first().map_or(0, |r| r.at_ns);
    let last = records.last().map_or(0, |r| r.at_ns);
    Ok(TraceSummary {
        records: records.len() as u64,
        span_s: last.saturating_sub(first) as f64 / 1e9,
        prompt_len: range(|r| r.prompt_len),
        output_len: range(|r| r.output_len),
    })
}

/// KV block hashes of a Mooncake request: each trace block id expands into
/// `block_tokens / tokens_per_block` KV blocks, and only KV blocks entirely inside the
/// prompt get a hash (the KV manager shares full blocks only).
pub(crate) fn expand_hashes(
    hash_ids: &[u64],
    prompt_len: u32,
    block_tokens: u32,
    tokens_per_block: u32,
) -> Vec<u64> {
    let per = block_tokens / tokens_per_block;
    let full = (prompt_len / tokens_per_block) as usize;
    hash_ids
        .iter()
        .flat_map(|&h| {
            (0..u64::from(per)).map(move |s| mix(h.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s))
        })
        .take(full)
        .collect()
}

fn parse_err(path: &str, line: usize, message: String) -> WorkloadError {
    WorkloadError::TraceParse {
        path: path.to_string(),
        line,
        message,
    }
}

/// Scaled nanoseconds; rounding keeps `time_scale = 1` exact for any realistic trace.
fn scaled_ns(ns: f64, time_scale: f64) -> u64 {
    (ns * time_scale).round() as u64
}

const MOONCAKE_FIELDS: [&str; 4] = ["timestamp", "input_length", "output_length", "hash_ids"];

/// Mooncake JSON Lines. Blank lines (the final newline) are skipped but still counted.
pub(crate) fn parse_mooncake(
    text: &str,
    path: &str,
    time_scale: f64,
    block_tokens: u32,
    limit: u64,
) -> Result<Vec<TraceRecord>, WorkloadError> {
    let mut out = Vec::new();
    let mut prev_ms = 0.0f64;
    for (i, raw) in text.lines().enumerate() {
        if out.len() as u64 >= limit {
            break;
        }
        let line = i + 1;
        let err = |message: String| parse_err(path, line, message);
        if raw.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(raw).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let Value::Object(obj) = v else {
            return Err(err(format!("expected a JSON object, got {v}")));
        };
        if let Some(k) = obj.keys().find(|k| !MOONCAKE_FIELDS.contains(&k.as_str())) {
            return Err(err(format!(
                "unknown field `{k}`; expected {}",
                MOONCAKE_FIELDS.join(", ")
            )));
        }
        let get = |name: &str| {
            obj.get(name)
                .ok_or_else(|| err(format!("missing field `{name}`")))
        };
        let ts = get("timestamp")?;
        let ms = ts
            .as_f64()
            .filter(|m| m.is_finite() && *m >= 0.0)
            .ok_or_else(|| err(format!("`timestamp` = {ts}: expected milliseconds >= 0")))?;
        if ms < prev_ms {
            return Err(err(format!(
                "`timestamp` = {ts} is before the previous record's {prev_ms}; timestamps must be non-decreasing"
            )));
        }
        prev_ms = ms;
        let length = |name: &str| -> Result<u32, WorkloadError> {
            let v = get(name)?;
            v.as_u64()
                .filter(|n| *n >= 1)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    err(format!(
                        "`{name}` = {v}: expected a whole number of tokens >= 1"
                    ))
                })
        };
        let prompt_len = length("input_length")?;
        let output_len = length("output_length")?;
        let hv = get("hash_ids")?;
        let hash_ids = hv
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                err(format!(
                    "`hash_ids` = {hv}: expected an array of integers >= 0"
                ))
            })?;
        // A mismatch means block_tokens does not match the trace's block size.
        let want = prompt_len.div_ceil(block_tokens) as usize;
        if hash_ids.len() != want {
            return Err(err(format!(
                "`hash_ids` has {} entries, but input_length = {prompt_len} needs {want} blocks of block_tokens = {block_tokens}",
                hash_ids.len()
            )));
        }
        out.push(TraceRecord {
            at_ns: scaled_ns(ms * 1e6, time_scale),
            prompt_len,
            output_len,
            hash_ids,
        });
    }
    if out.is_empty() {
        return Err(parse_err(path, 1, "the trace has no records".into()));
    }
    Ok(out)
}

const AZURE_COLUMNS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Azure CSV. Lines may end in CRLF, the last one may lack a line break; arrivals are
/// relative to the first row.
pub(crate) fn parse_azure(
    text: &str,
    path: &str,
    time_scale: f64,
    limit: u64,
) -> Result<Vec<TraceRecord>, WorkloadError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // `lines` strips a trailing `\r` as well as the `\n`.
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, h)| h).unwrap_or("");
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let mut col = [0usize; 3];
    for (slot, want) in col.iter_mut().zip(AZURE_COLUMNS) {
        *slot = names.iter().position(|n| *n == want).ok_or_else(|| {
            parse_err(
                path,
                1,
                format!(
                    "header `{header}` lacks the column `{want}`; expected {}",
                    AZURE_COLUMNS.join(",")
                ),
            )
        })?;
    }
    let mut out = Vec::new();
    let mut first_ns: Option<i128> = None;
    let mut prev_ns = i128::MIN;
    for (i, raw) in lines {
        if out.len() as u64 >= limit {
            break;
        }
        let line = i + 1;
        let err = |message: String| parse_err(path, line, message);
        if raw.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = raw.split(',').map(str::trim).collect();
        if fields.len() != names.len() {
            return Err(err(format!(
                "{} fields, but the header has {}",
                fields.len(),
                names.len()
            )));
        }
        let ts = fields[col[0]];
        let ns = parse_datetime(ts).map_err(|m| err(format!("`TIMESTAMP` = {ts:?}: {m}")))?;
        if ns < prev_ns {
            return Err(err(format!(
                "`TIMESTAMP` = {ts:?} is before the previous row's; timestamps must be non-decreasing"
            )));
        }
        prev_ns = ns;
        let t0 = *first_ns.get_or_insert(ns);
        let tokens = |idx: usize, name: &str| -> Result<u32, WorkloadError> {
            let v = fields[idx];
            v.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                err(format!(
                    "`{name}` = {v:?}: expected a whole number of tokens >= 1"
                ))
            })
        };
        let prompt_len = tokens(col[1], AZURE_COLUMNS[1])?;
        let output_len = tokens(col[2], AZURE_COLUMNS[2])?;
        out.push(TraceRecord {
            at_ns: scaled_ns((ns - t0) as f64, time_scale),
            prompt_len,
            output_len,
            hash_ids: Vec::new(),
        });
    }
    if out.is_empty() {
        return Err(parse_err(path, 2, "the trace has no data rows".into()));
    }
    Ok(out)
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fffffff]` (up to 9 fractional digits, no zone) into
/// nanoseconds since 1970-01-01 00:00:00, so rows on different dates still order.
pub(crate) fn parse_datetime(s: &str) -> Result<i128, String> {
    let (date, time) = s
        .split_once(' ')
        .ok_or("expected `YYYY-MM-DD HH:MM:SS.fffffff`")?;
    let num = |part: &str, what: &str, lo: u32, hi: u32| -> Result<u32, String> {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("{what} {part:?} is not a number"));
        }
        let n: u32 = part
            .parse()
            .map_err(|_| format!("{what} {part:?} is too large"))?;
        if n < lo || n > hi {
            return Err(format!("{what} {n} is outside {lo}..={hi}"));
        }
        Ok(n)
    };
    let d: Vec<&str> = date.split('-').collect();
    let [y, mo, dd] = d[..] else {
        return Err(format!("date {date:?} is not YYYY-MM-DD"));
    };
    let year = num(y, "year", 1, 9999)?;
    let month = num(mo, "month", 1, 12)?;
    let day = num(dd, "day", 1, days_in_month(year, month))?;
    let (hms, frac) = match time.split_once('.') {
        Some((hms, f)) => (hms, Some(f)),
        None => (time, None),
    };
    let t: Vec<&str> = hms.split(':').collect();
    let [h, mi, se] = t[..] else {
        return Err(format!("time {time:?} is not HH:MM:SS"));
    };
    let hour = num(h, "hour", 0, 23)?;
    let minute = num(mi, "minute", 0, 59)?;
    let second = num(se, "second", 0, 59)?;
    let nanos = match frac {
        None => 0,
        Some(f) if f.len() > 9 => return Err(format!("fraction {f:?} has more than 9 digits")),
        Some(f) => num(f, "fraction", 0, 999_999_999)? * 10u32.pow(9 - f.len() as u32),
    };
    let days = days_from_civil(i64::from(year), month, day);
    let secs = days * 86_400 + i64::from(hour * 3600 + minute * 60 + second);
    Ok(i128::from(secs) * 1_000_000_000 + i128::from(nanos))
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        // The calendar arithmetic already knows leap years.
        2 => {
            (days_from_civil(i64::from(year), 3, 1) - days_from_civil(i64::from(year), 2, 1)) as u32
        }
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
pub(crate) fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
