//! The backend trait and the analytic (linear) cost model.

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::BatchShape;

/// Coefficients of the analytic model, all in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Coefficients {
    /// Fixed per forward (kernel launches, weights read once).
    pub forward_base_ns: f64,
    /// Per context token (GEMMs).
    pub ctx_token_ns: f64,
    /// Per unit of [`BatchShape::ctx_attention`].
    pub ctx_attention_ns: f64,
    /// Per generation request and per dummy (sampling, per-sequence bookkeeping).
    pub gen_request_ns: f64,
    /// Per generation token (draft tokens included) and per dummy.
    pub gen_token_ns: f64,
    /// Per cached KV token attended by generation.
    pub kv_read_ns: f64,
    /// Per forward, the ADP/MoE collectives (all ranks wait for the slowest).
    pub collective_ns: f64,
    /// Host scheduling overhead per iteration.
    pub host_base_ns: f64,
    /// Host overhead per scheduled real request.
    pub host_per_request_ns: f64,
}

impl Coefficients {
    /// Every coefficient with its key, in declaration order (the one list that checks
    /// and reports walk).
    pub fn terms(&self) -> [(&'static str, f64); 9] {
        [
            ("forward_base_ns", self.forward_base_ns),
            ("ctx_token_ns", self.ctx_token_ns),
            ("ctx_attention_ns", self.ctx_attention_ns),
            ("gen_request_ns", self.gen_request_ns),
            ("gen_token_ns", self.gen_token_ns),
            ("kv_read_ns", self.kv_read_ns),
            ("collective_ns", self.collective_ns),
            ("host_base_ns", self.host_base_ns),
            ("host_per_request_ns", self.host_per_request_ns),
        ]
    }
}

/// Modeled time of one server iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IterationTime {
    /// Host time: the slowest rank's.
    pub host_ns: u64,
    /// Device time: the slowest rank's forward plus the collectives; 0 without a forward.
    pub device_ns: u64,
    /// What the iteration lasts on the clock.
    pub total_ns: u64,
}

/// The backend trait: modeled times of one rank's forward and of a whole server iteration.
pub trait Backend {
    /// One rank's device time (0 for an empty shape).
    fn forward_ns(&self, shape: &BatchShape) -> u64;

    /// One rank's host time for this iteration.
    fn host_ns(&self, shape: &BatchShape) -> u64;

    /// The time of the collectives of one forward; charged once when any rank ran.
    fn collective_ns(&self) -> u64 {
        0
    }

    /// A server iteration: device time = max over ranks + collective (if any rank ran);
    /// host = max over ranks; with `overlap` the host prepares the next batch while the
    /// device runs, so `max(host, device)`, otherwise `host + device`.
    /// `forward_ran = false` (the vote found a rank with nothing scheduled): host only.
    fn iteration_ns(
        &self,
        shapes: &[BatchShape],
        forward_ran: bool,
        overlap: bool,
    ) -> IterationTime {
        let host_ns = shapes.iter().map(|s| self.host_ns(s)).max().unwrap_or(0);
        let device_ns = if forward_ran && shapes.iter().any(|s| !s.is_empty()) {
            // Lockstep: every rank waits for the slowest before the collectives complete.
            let slowest = shapes.iter().map(|s| self.forward_ns(s)).max().unwrap_or(0);
            slowest.saturating_add(self.collective_ns())
        } else {
            0
        };
        let total_ns = if overlap {
            host_ns.max(device_ns)
        } else {
            host_ns.saturating_add(device_ns)
        };
        IterationTime {
            host_ns,
            device_ns,
            total_ns,
        }
    }
}

/// The analytic backend: linear in the shape terms, rounded to whole nanoseconds, never
/// negative.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AnalyticBackend {
    /// The coefficients.
    pub coefficients: Coefficients,
}

impl AnalyticBackend {
    /// A backend with these coefficients.
    pub fn new(coefficients: Coefficients) -> Self {
        Self { coefficients }
    }
}

/// Rounds a modeled time; negative or NaN (nonsense coefficients) becomes 0 rather than
/// wrapping, and huge values saturate.
fn to_ns(x: f64) -> u64 {
    x.round().max(0.0) as u64
}

impl Backend for AnalyticBackend {
    fn forward_ns(&self, s: &BatchShape) -> u64 {
        if s.is_empty() {
            return 0;
        }
        let c = &self.coefficients;
        // Dummies run as one-token generation steps: one row and one sampled token each.
        let gen_rows = f64::from(s.gen_requests) + f64::from(s.dummies);
        let gen_tokens = f64::from(s.gen_tokens) + f64::from(s.dummies);
        to_ns(
            c.forward_base_ns
                + c.ctx_token_ns * f64::from(s.ctx_tokens)
                + c.ctx_attention_ns * s.ctx_attention as f64
                + c.gen_request_ns * gen_rows
                + c.gen_token_ns * gen_tokens
                + c.kv_read_ns * s.gen_kv_tokens as f64,
        )
    }

    fn host_ns(&self, s: &BatchShape) -> u64 {
        let c = &self.coefficients;
        let requests = f64::from(s.ctx_requests) + f64::from(s.gen_requests);
        to_ns(c.host_base_ns + c.host_per_request_ns * requests)
    }

    fn collective_ns(&self) -> u64 {
        to_ns(self.coefficients.collective_ns)
    }
}

/// Every time is 0: measures the control plane's own overhead in the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ZeroCostBackend;

impl Backend for ZeroCostBackend {
    fn forward_ns(&self, _: &BatchShape) -> u64 {
        0
    }

    fn host_ns(&self, _: &BatchShape) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round numbers so expected times can be computed by hand.
    fn coeffs() -> Coefficients {
        Coefficients {
            forward_base_ns: 1000.0,
            ctx_token_ns: 10.0,
            ctx_attention_ns: 0.5,
            gen_request_ns: 7.0,
            gen_token_ns: 3.0,
            kv_read_ns: 2.0,
            collective_ns: 500.0,
            host_base_ns: 100.0,
            host_per_request_ns: 4.0,
        }
    }

    fn backend() -> AnalyticBackend {
        AnalyticBackend::new(coeffs())
    }

    fn decode(requests: u32, kv: u64) -> BatchShape {
        BatchShape {
            gen_requests: requests,
            gen_tokens: requests,
            gen_kv_tokens: kv,
            ..BatchShape::default()
        }
    }

    #[test]
    fn forward_time_is_zero_for_an_empty_shape() {
        assert_eq!(backend().forward_ns(&BatchShape::default()), 0);
    }

    #[test]
    fn forward_time_is_the_linear_formula() {
        let s = BatchShape {
            ctx_requests: 1,
            ctx_tokens: 100,
            ctx_attention: 100 * 300,
            gen_requests: 2,
            gen_tokens: 5,
            gen_kv_tokens: 1000,
            dummies: 1,
        };
        let want = 1000 + 10 * 100 + 15_000 + 7 * 3 + 3 * 6 + 2 * 1000;
        assert_eq!(backend().forward_ns(&s), want);
    }

    #[test]
    fn forward_time_grows_strictly_in_every_term() {
        let b = backend();
        let base = BatchShape {
            ctx_requests: 1,
            ctx_tokens: 10,
            ctx_attention: 100,
            gen_requests: 1,
            gen_tokens: 1,
            gen_kv_tokens: 10,
            dummies: 0,
        };
        let t0 = b.forward_ns(&base);
        type Bump = fn(&mut BatchShape);
        let bumps: [(&str, Bump); 5] = [
            ("ctx_tokens", |s| s.ctx_tokens += 1),
            ("ctx_attention", |s| s.ctx_attention += 10),
            ("gen_requests", |s| s.gen_requests += 1),
            ("gen_tokens", |s| s.gen_tokens += 1),
            ("gen_kv_tokens", |s| s.gen_kv_tokens += 1),
        ];
        for (name, bump) in bumps {
            let mut s = base;
            bump(&mut s);
            assert!(
                b.forward_ns(&s) > t0,
                "forward time did not grow with {name}"
            );
        }
        let mut s = base;
        s.dummies += 1;
        assert!(
            b.forward_ns(&s) > t0,
            "forward time did not grow with dummies"
        );
        // A lone dummy costs what a one-token generation step attending nothing costs.
        let dummy = BatchShape {
            dummies: 1,
            ..BatchShape::default()
        };
        assert_eq!(b.forward_ns(&dummy), b.forward_ns(&decode(1, 0)));
    }

    #[test]
    fn host_time_is_base_plus_per_real_request() {
        let b = backend();
        assert_eq!(b.host_ns(&BatchShape::default()), 100);
        let s = BatchShape {
            ctx_requests: 2,
            gen_requests: 3,
            dummies: 5,
            ..BatchShape::default()
        };
        assert_eq!(b.host_ns(&s), 100 + 4 * 5);
    }

    #[test]
    fn iteration_device_time_is_the_slowest_rank_plus_the_collective() {
        let b = backend();
        let shapes = [decode(1, 0), decode(4, 5000), BatchShape::default()];
        let slowest = b.forward_ns(&shapes[1]);
        assert!(slowest > b.forward_ns(&shapes[0]));
        let t = b.iteration_ns(&shapes, true, false);
        assert_eq!(t.device_ns, slowest + 500);
        // Host is the slowest rank's too: base + 4 requests.
        assert_eq!(t.host_ns, 100 + 4 * 4);
    }

    #[test]
    fn overlap_takes_the_max_of_host_and_device_and_non_overlap_adds_them() {
        let b = backend();
        let shapes = [decode(2, 100), decode(1, 50)];
        let serial = b.iteration_ns(&shapes, true, false);
        let overlapped = b.iteration_ns(&shapes, true, true);
        assert_eq!(serial.host_ns, overlapped.host_ns);
        assert_eq!(serial.device_ns, overlapped.device_ns);
        assert_eq!(serial.total_ns, serial.host_ns + serial.device_ns);
        assert_eq!(overlapped.total_ns, serial.device_ns.max(serial.host_ns));
        // A host slower than the device dominates under overlap.
        let slow_host = AnalyticBackend::new(Coefficients {
            host_base_ns: 1e6,
            ..coeffs()
        });
        let t = slow_host.iteration_ns(&shapes, true, true);
        assert_eq!(t.total_ns, 1_000_000 + 4 * 2);
    }

    #[test]
    fn a_skipped_forward_costs_host_time_only() {
        let b = backend();
        let shapes = [decode(3, 100), BatchShape::default()];
        for overlap in [false, true] {
            let t = b.iteration_ns(&shapes, false, overlap);
            assert_eq!(t.device_ns, 0);
            assert_eq!(t.host_ns, 100 + 4 * 3);
            assert_eq!(t.total_ns, t.host_ns);
        }
    }

    #[test]
    fn a_forward_where_no_rank_has_work_charges_no_collective() {
        let t = backend().iteration_ns(&[BatchShape::default(); 4], true, false);
        assert_eq!(t.device_ns, 0);
        assert_eq!(t.total_ns, 100);
    }

    #[test]
    fn negative_totals_round_to_zero_rather_than_wrap() {
        let b = AnalyticBackend::new(Coefficients {
            forward_base_ns: -1e9,
            host_base_ns: f64::NAN,
            ..coeffs()
        });
        assert_eq!(b.forward_ns(&decode(1, 0)), 0);
        assert_eq!(b.host_ns(&decode(1, 0)), 0);
    }

    #[test]
    fn the_zero_cost_backend_charges_nothing() {
        let shapes = [decode(100, 1 << 20), decode(1, 1)];
        assert_eq!(
            ZeroCostBackend.iteration_ns(&shapes, true, false),
            IterationTime::default()
        );
    }
}
