//! Goodput: completed requests per second that meet every given service-level
//! objective (`--slo ttft_ms=…,tpot_ms=…,e2e_ms=…`), as vLLM's benchmark defines it.

use std::str::FromStr;

use super::schema::{Goodput, Report, Slo};

/// A `--slo` that cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SloError {
    /// Not `KEY=VALUE`.
    #[error("--slo: `{0}` is not KEY=VALUE (keys: ttft_ms, tpot_ms, e2e_ms)")]
    NotKeyValue(String),
    /// A key that is not an objective.
    #[error("--slo: unknown key `{0}` (keys: ttft_ms, tpot_ms, e2e_ms)")]
    UnknownKey(String),
    /// A value that is not a positive finite number of milliseconds.
    #[error("--slo: {key} must be a positive number of milliseconds, got `{value}`")]
    BadValue {
        /// The key.
        key: String,
        /// Its value.
        value: String,
    },
    /// The same key twice.
    #[error("--slo: {0} given twice")]
    Repeated(String),
    /// Nothing given.
    #[error("--slo: no objective given (keys: ttft_ms, tpot_ms, e2e_ms)")]
    Empty,
}

impl FromStr for Slo {
    type Err = SloError;

    fn from_str(text: &str) -> Result<Slo, SloError> {
        let mut slo = Slo::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| SloError::NotKeyValue(part.to_string()))?;
            let (key, value) = (key.trim(), value.trim());
            let slot = match key {
                "ttft_ms" => &mut slo.ttft_ms,
                "tpot_ms" => &mut slo.tpot_ms,
                "e2e_ms" => &mut slo.e2e_ms,
                _ => return Err(SloError::UnknownKey(key.to_string())),
            };
            let v: f64 = value.parse().map_err(|_| SloError::BadValue {
                key: key.to_string(),
                value: value.to_string(),
            })?;
            if !(v.is_finite() && v > 0.0) {
                return Err(SloError::BadValue {
                    key: key.to_string(),
                    value: value.to_string(),
                });
            }
            if slot.replace(v).is_some() {
                return Err(SloError::Repeated(key.to_string()));
            }
        }
        if slo == Slo::default() {
            return Err(SloError::Empty);
        }
        Ok(slo)
    }
}

/// `ttft_ms=200,tpot_ms=20`: what `--slo` reads back.
impl std::fmt::Display for Slo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        for (name, v) in [
            ("ttft_ms", self.ttft_ms),
            ("tpot_ms", self.tpot_ms),
            ("e2e_ms", self.e2e_ms),
        ] {
            if let Some(v) = v {
                parts.push(format!("{name}={v}"));
            }
        }
        f.write_str(&parts.join(","))
    }
}

impl Slo {
    /// `ttft ≤ 200 ms, tpot ≤ 20 ms` (for tables and legends).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (name, v) in [
            ("ttft", self.ttft_ms),
            ("tpot", self.tpot_ms),
            ("e2e", self.e2e_ms),
        ] {
            if let Some(v) = v {
                parts.push(format!("{name} ≤ {v} ms"));
            }
        }
        parts.join(", ")
    }
}

impl Report {
    /// Computes the goodput under `slo` from the per-request times: measured
    /// (non-warm-up) requests that completed within every objective, per second of the
    /// measured load.
    pub fn apply_slo(&mut self, slo: &Slo) {
        let warmup = self.requests.warmup;
        let within = |value: Option<f64>, limit: Option<f64>| match limit {
            None => true,
            Some(l) => value.is_some_and(|v| v <= l),
        };
        let good = self
            .per_request
            .iter()
            .filter(|d| d.id > warmup && d.failure().is_none() && d.end_ms().is_some())
            .filter(|d| {
                within(d.ttft_ms(), slo.ttft_ms)
                    && within(d.tpot_ms(), slo.tpot_ms)
                    && within(d.e2e_ms(), slo.e2e_ms)
            })
            .count() as u64;
        let secs = self.throughput.duration_s;
        self.goodput = Some(Goodput {
            slo: *slo,
            good_requests: good,
            requests_per_s: if secs > 0.0 { good as f64 / secs } else { 0.0 },
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_reads_every_key_and_names_a_bad_one() {
        let s: Slo = "ttft_ms=200, tpot_ms=20,e2e_ms=1000".parse().unwrap();
        assert_eq!(s.ttft_ms, Some(200.0));
        assert_eq!(s.tpot_ms, Some(20.0));
        assert_eq!(s.e2e_ms, Some(1000.0));
        let e = "ttft_ms=fast".parse::<Slo>().unwrap_err().to_string();
        assert!(e.contains("ttft_ms") && e.contains("`fast`"), "{e}");
        let e = "tpot_ms=-1".parse::<Slo>().unwrap_err().to_string();
        assert!(e.contains("tpot_ms") && e.contains("`-1`"), "{e}");
        let e = "ttft_ms=NaN".parse::<Slo>().unwrap_err().to_string();
        assert!(e.contains("ttft_ms"), "{e}");
        let e = "itl_ms=5".parse::<Slo>().unwrap_err().to_string();
        assert!(e.contains("unknown key `itl_ms`"), "{e}");
        let e = "ttft_ms".parse::<Slo>().unwrap_err().to_string();
        assert!(e.contains("`ttft_ms` is not KEY=VALUE"), "{e}");
        assert!("ttft_ms=1,ttft_ms=2".parse::<Slo>().is_err());
        assert_eq!("".parse::<Slo>(), Err(SloError::Empty));
        assert_eq!(s.to_string().parse::<Slo>(), Ok(s));
    }
}
