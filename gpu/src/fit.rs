//! Fitting the analytic cost model's device coefficients to measured forward times
//! (`lockstep model calibrate`): least squares over the terms of
//! [`AnalyticBackend`](crate::AnalyticBackend)'s `forward_ns`, with every coefficient
//! kept at 0 or above (a term the data says costs nothing is dropped and the rest
//! refitted, as non-negative least squares does).
//!
//! Without draft tokens a generation request puts exactly one token into the forward, so
//! the per-request and per-token terms cannot be told apart: the fit puts their sum in
//! `gen_request_ns` and leaves `gen_token_ns` at 0.

use crate::BatchShape;

/// The device terms the fit estimates, in `forward_ns` order.
const TERMS: [&str; 5] = [
    "forward_base_ns",
    "ctx_token_ns",
    "ctx_attention_ns",
    "gen_request_ns",
    "kv_read_ns",
];

/// One measured forward: the rank's batch shape and how long it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// The batch.
    pub shape: BatchShape,
    /// Its measured forward time.
    pub ns: f64,
}

/// The fitted device coefficients (the fields of [`crate::Coefficients`] a forward's
/// time depends on).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DeviceFit {
    /// Fixed per forward.
    pub forward_base_ns: f64,
    /// Per context token.
    pub ctx_token_ns: f64,
    /// Per unit of `ctx_attention`.
    pub ctx_attention_ns: f64,
    /// Per generation request (its one token included).
    pub gen_request_ns: f64,
    /// Per cached token attended by generation.
    pub kv_read_ns: f64,
}

impl DeviceFit {
    /// The cost model's coefficients: these device terms, the given collective time and
    /// host terms. The fit has no per-generation-token term: without draft tokens it
    /// cannot tell a request from its one token, so `gen_request_ns` carries both.
    pub fn coefficients(
        &self,
        collective_ns: f64,
        host_base_ns: f64,
        host_per_request_ns: f64,
    ) -> crate::Coefficients {
        crate::Coefficients {
            forward_base_ns: self.forward_base_ns,
            ctx_token_ns: self.ctx_token_ns,
            ctx_attention_ns: self.ctx_attention_ns,
            gen_request_ns: self.gen_request_ns,
            gen_token_ns: 0.0,
            kv_read_ns: self.kv_read_ns,
            collective_ns,
            host_base_ns,
            host_per_request_ns,
        }
    }

    /// The fitted time of `shape` (what `forward_ns` gives with these coefficients).
    pub fn predict(&self, shape: &BatchShape) -> f64 {
        let x = features(shape);
        let c = self.as_array();
        x.iter().zip(c).map(|(x, c)| x * c).sum()
    }

    fn as_array(&self) -> [f64; 5] {
        [
            self.forward_base_ns,
            self.ctx_token_ns,
            self.ctx_attention_ns,
            self.gen_request_ns,
            self.kv_read_ns,
        ]
    }

    fn from_array(c: [f64; 5]) -> DeviceFit {
        DeviceFit {
            forward_base_ns: c[0],
            ctx_token_ns: c[1],
            ctx_attention_ns: c[2],
            gen_request_ns: c[3],
            kv_read_ns: c[4],
        }
    }
}

/// Why a fit is impossible.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Fewer samples than terms, or a time that is not a finite number above 0.
    #[error("calibration samples: {0}")]
    BadSamples(String),
    /// The samples do not vary a term independently of the others.
    #[error("calibration samples do not separate the term {0} from the others")]
    Degenerate(&'static str),
}

fn features(s: &BatchShape) -> [f64; 5] {
    // Dummies run as one-token generation steps, as in `forward_ns`.
    let gen_rows = f64::from(s.gen_requests) + f64::from(s.dummies);
    [
        1.0,
        f64::from(s.ctx_tokens),
        s.ctx_attention as f64,
        gen_rows,
        s.gen_kv_tokens as f64,
    ]
}

/// Fits the device coefficients to `samples`: least squares of the relative errors, with
/// every coefficient kept at 0 or above.
pub fn fit_device(samples: &[Sample]) -> Result<DeviceFit, FitError> {
    if samples.len() < TERMS.len() {
        return Err(FitError::BadSamples(format!(
            "{} samples, at least {} needed",
            samples.len(),
            TERMS.len()
        )));
    }
    if let Some(bad) = samples.iter().find(|s| !(s.ns.is_finite() && s.ns > 0.0)) {
        return Err(FitError::BadSamples(format!(
            "a forward time of {} ns",
            bad.ns
        )));
    }
    // Relative errors: each row divided by its measured time, so a 3 ms decode step
    // weighs as much as a 75 ms prefill.
    let rows: Vec<[f64; 5]> = samples
        .iter()
        .map(|s| features(&s.shape).map(|x| x / s.ns))
        .collect();
    let y: Vec<f64> = vec![1.0; samples.len()];
    let mut active = [true; 5];
    loop {
        let c = least_squares(&rows, &y, &active)?;
        // Drop the most negative term and refit; done when none is negative.
        let worst = (0..5)
            .filter(|&j| active[j] && c[j] < 0.0)
            .min_by(|&a, &b| c[a].total_cmp(&c[b]));
        match worst {
            Some(j) => active[j] = false,
            None => return Ok(DeviceFit::from_array(c)),
        }
    }
}

/// Ordinary least squares over the active columns (the others fixed at 0), through the
/// normal equations on columns scaled to a maximum of 1 (the terms differ by orders of
/// magnitude).
fn least_squares(rows: &[[f64; 5]], y: &[f64], active: &[bool; 5]) -> Result<[f64; 5], FitError> {
    let cols: Vec<usize> = (0..5).filter(|&j| active[j]).collect();
    let n = cols.len();
    let scale: Vec<f64> = cols
        .iter()
        .map(|&j| rows.iter().map(|r| r[j].abs()).fold(0.0, f64::max))
        .collect();
    if let Some(k) = scale.iter().position(|&s| s == 0.0) {
        return Err(FitError::Degenerate(TERMS[cols[k]]));
    }
    // A = XᵀX, b = Xᵀy on the scaled columns; then Gaussian elimination with pivoting.
    let mut a = vec![vec![0.0; n + 1]; n];
    for (r, &yi) in rows.iter().zip(y) {
        for p in 0..n {
            let xp = r[cols[p]] / scale[p];
            for q in 0..n {
                a[p][q] += xp * r[cols[q]] / scale[q];
            }
            a[p][n] += xp * yi;
        }
    }
    for p in 0..n {
        let pivot = (p..n)
            .max_by(|&i, &k| a[i][p].abs().total_cmp(&a[k][p].abs()))
            .unwrap_or(p);
        a.swap(p, pivot);
        // Relative to the diagonal's size before elimination (the scaled columns keep it
        // within a few orders of magnitude of 1 for independent terms).
        if a[p][p].abs() < 1e-9 * rows.len() as f64 {
            return Err(FitError::Degenerate(TERMS[cols[p]]));
        }
        let pivot_row = a[p].clone();
        for (i, row) in a.iter_mut().enumerate() {
            if i != p {
                let f = row[p] / pivot_row[p];
                for (x, pv) in row[p..].iter_mut().zip(&pivot_row[p..]) {
                    *x -= f * pv;
                }
            }
        }
    }
    let mut c = [0.0; 5];
    for (p, &j) in cols.iter().enumerate() {
        c[j] = a[p][n] / a[p][p] / scale[p];
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(requests: u32, chunk: u32, cached: u32) -> BatchShape {
        BatchShape {
            ctx_requests: requests,
            ctx_tokens: requests * chunk,
            ctx_attention: u64::from(requests) * u64::from(chunk) * u64::from(cached + chunk),
            ..BatchShape::default()
        }
    }

    fn generation(requests: u32, kv: u32) -> BatchShape {
        BatchShape {
            gen_requests: requests,
            gen_tokens: requests,
            gen_kv_tokens: u64::from(requests) * u64::from(kv),
            ..BatchShape::default()
        }
    }

    fn grid() -> Vec<BatchShape> {
        let mut shapes = Vec::new();
        for chunk in [16, 64, 256] {
            for cached in [0, 128] {
                for requests in [1, 2] {
                    shapes.push(ctx(requests, chunk, cached));
                }
            }
        }
        for requests in [1, 2, 4, 8] {
            for kv in [32, 256] {
                shapes.push(generation(requests, kv));
            }
        }
        shapes
    }

    #[test]
    fn recovers_the_coefficients_that_made_the_times() {
        let truth = DeviceFit {
            forward_base_ns: 400_000.0,
            ctx_token_ns: 9_000.0,
            ctx_attention_ns: 2.5,
            gen_request_ns: 30_000.0,
            kv_read_ns: 40.0,
        };
        let samples: Vec<Sample> = grid()
            .into_iter()
            .map(|shape| Sample {
                shape,
                ns: truth.predict(&shape),
            })
            .collect();
        let fit = fit_device(&samples).unwrap();
        for (got, want) in fit.as_array().iter().zip(truth.as_array()) {
            assert!((got - want).abs() <= want * 1e-6, "{fit:?} vs {truth:?}");
        }
    }

    #[test]
    fn a_term_the_data_says_is_free_is_zero_not_negative() {
        // Times with no attention cost at all, and a little noise that would pull an
        // unconstrained fit of that term below 0.
        let truth = DeviceFit {
            forward_base_ns: 100_000.0,
            ctx_token_ns: 5_000.0,
            ctx_attention_ns: 0.0,
            gen_request_ns: 10_000.0,
            kv_read_ns: 10.0,
        };
        let samples: Vec<Sample> = grid()
            .into_iter()
            .enumerate()
            .map(|(i, shape)| {
                let wobble = if i % 2 == 0 { 0.97 } else { 1.03 };
                Sample {
                    shape,
                    ns: truth.predict(&shape) * wobble,
                }
            })
            .collect();
        let fit = fit_device(&samples).unwrap();
        assert!(fit.as_array().iter().all(|c| *c >= 0.0), "{fit:?}");
        let worst = samples
            .iter()
            .map(|s| (fit.predict(&s.shape) - s.ns).abs() / s.ns)
            .fold(0.0, f64::max);
        assert!(worst < 0.1, "worst relative error {worst}");
    }

    #[test]
    fn samples_that_never_vary_a_term_are_refused_naming_it() {
        // Only generation batches: nothing says what a context token costs.
        let samples: Vec<Sample> = (1..=8)
            .map(|r| Sample {
                shape: generation(r, 64),
                ns: 1e5 + 1e4 * f64::from(r),
            })
            .collect();
        let err = fit_device(&samples).unwrap_err();
        assert!(err.to_string().contains("ctx_token_ns"), "{err}");
        let few = &samples[..3];
        assert!(
            fit_device(few)
                .unwrap_err()
                .to_string()
                .contains("3 samples")
        );
        let mut bad = samples.clone();
        bad[0].ns = f64::NAN;
        assert!(fit_device(&bad).unwrap_err().to_string().contains("NaN"));
    }
}
