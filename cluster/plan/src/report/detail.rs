//! One request's record: what the client saw of it (kept while the run goes, as the
//! request's only per-request state there) and what the report's `per_request` says of it.
//!
//! It is held for every request of a run, so it is compact: times are integer
//! nanoseconds on the report's clock, an absent time is a sentinel rather than an
//! `Option` (which would double its size), the digest is an integer and a failure's
//! text is boxed (most requests have none). 88 bytes in all. The JSON keeps the
//! readable form (milliseconds, a hex digest), written from and read into this one.

use serde::{Deserialize, Serialize};

use lockstep_actors::vocab::FailureKind;

/// A time in nanoseconds that may be absent (`u64::MAX`: an `Option<u64>` takes 16
/// bytes, this 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaybeNs(u64);

impl MaybeNs {
    const NONE: MaybeNs = MaybeNs(u64::MAX);

    fn get(self) -> Option<u64> {
        (self != Self::NONE).then_some(self.0)
    }

    /// `u64::MAX` itself is kept one below, so it still reads as a time.
    fn of(ns: Option<u64>) -> MaybeNs {
        ns.map_or(Self::NONE, |ns| MaybeNs(ns.min(u64::MAX - 1)))
    }
}

/// Why a request did not complete: its kind (absent in reports written before kinds
/// existed) and the text a client reads.
#[derive(Debug, Clone, PartialEq)]
struct Failed {
    kind: Option<FailureKind>,
    why: String,
}

/// One request's outcome and times. Times are on the report's clock (`time_base`) from
/// the run's start; equality compares the outcome only (id, tokens, digest, failure),
/// what every driver must agree on, since each driver has its clock.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(into = "RequestDetailJson", from = "RequestDetailJson")]
pub struct RequestDetail {
    /// Request id.
    pub id: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens received.
    pub output_tokens: u32,
    /// When the client sent it (ns).
    pub arrival_ns: u64,
    /// When the latest output tokens reached the client (ns; the start of the next
    /// inter-token gap; not reported).
    pub last_token_ns: u64,
    /// A digest of the token stream received.
    pub token_digest: u64,
    /// Its wait at the serving front door for a process (ns; 0 without one).
    pub front_queue_ns: u64,
    /// Its service there: parse, tokenize, hand-off (ns).
    pub front_service_ns: u64,
    first_scheduled_ns: MaybeNs,
    first_token_ns: MaybeNs,
    end_ns: MaybeNs,
    failure: Option<Box<Failed>>,
}

impl RequestDetail {
    /// A request of `prompt_tokens` tokens that arrived at `arrival_ns`, nothing else
    /// known yet.
    pub fn new(id: u64, prompt_tokens: u32, arrival_ns: u64) -> RequestDetail {
        RequestDetail {
            id,
            prompt_tokens,
            output_tokens: 0,
            arrival_ns,
            last_token_ns: 0,
            token_digest: 0,
            front_queue_ns: 0,
            front_service_ns: 0,
            first_scheduled_ns: MaybeNs::NONE,
            first_token_ns: MaybeNs::NONE,
            end_ns: MaybeNs::NONE,
            failure: None,
        }
    }

    /// When a rank first scheduled it (took a seat for it), on the clock of the server's
    /// rank 0 at that iteration's fetch (ns).
    pub fn first_scheduled_ns(&self) -> Option<u64> {
        self.first_scheduled_ns.get()
    }

    /// Records that a rank scheduled it at `ns`; the earliest of several counts.
    pub fn scheduled_at(&mut self, ns: u64) {
        let earliest = self.first_scheduled_ns().map_or(ns, |t| t.min(ns));
        self.first_scheduled_ns = MaybeNs::of(Some(earliest));
    }

    /// When its first output token reached the client (ns).
    pub fn first_token_ns(&self) -> Option<u64> {
        self.first_token_ns.get()
    }

    /// Sets when its first output token reached the client (ns).
    pub fn set_first_token_ns(&mut self, ns: Option<u64>) {
        self.first_token_ns = MaybeNs::of(ns);
    }

    /// When it completed or failed at the client (ns).
    pub fn end_ns(&self) -> Option<u64> {
        self.end_ns.get()
    }

    /// Ends it at `now_ns`, completed (`None`) or failed; a request ends once.
    pub fn end(&mut self, now_ns: u64, failure: Option<(FailureKind, String)>) {
        if self.end_ns().is_none() {
            self.end_ns = MaybeNs::of(Some(now_ns));
            self.failure = failure.map(|(kind, why)| {
                Box::new(Failed {
                    kind: Some(kind),
                    why,
                })
            });
        }
    }

    /// Marks a request still open when the run ended as failed for `why` (its end time
    /// stays unknown).
    pub fn mark_unfinished(&mut self, why: &str) {
        if self.end_ns().is_none() {
            self.failure = Some(Box::new(Failed {
                kind: Some(FailureKind::Unfinished),
                why: why.into(),
            }));
        }
    }

    /// Maps the times the client took (arrival, first token, end, front door) through
    /// `f`: a real driver's wall clock onto the modeled one.
    pub fn map_client_times(&mut self, f: impl Fn(u64) -> u64) {
        self.arrival_ns = f(self.arrival_ns);
        self.first_token_ns = MaybeNs::of(self.first_token_ns().map(&f));
        self.end_ns = MaybeNs::of(self.end_ns().map(&f));
        self.front_queue_ns = f(self.front_queue_ns);
        self.front_service_ns = f(self.front_service_ns);
    }

    /// Ended and completed (rather than failed, or still open).
    pub fn completed(&self) -> bool {
        self.end_ns().is_some() && self.failure.is_none()
    }

    /// The failure reason, if it failed.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_ref().map(|f| f.why.as_str())
    }

    /// The failure's kind (what a classifier branches on; `failure` is its text).
    pub fn failure_kind(&self) -> Option<FailureKind> {
        self.failure.as_ref().and_then(|f| f.kind)
    }

    /// The digest of the token stream, as the JSON writes it.
    pub fn token_digest_hex(&self) -> String {
        format!("{:016x}", self.token_digest)
    }

    /// When the client sent it (ms).
    pub fn arrival_ms(&self) -> f64 {
        ms(self.arrival_ns)
    }

    /// When a rank first scheduled it (ms).
    pub fn first_scheduled_ms(&self) -> Option<f64> {
        self.first_scheduled_ns().map(ms)
    }

    /// When its first output token reached the client (ms).
    pub fn first_token_ms(&self) -> Option<f64> {
        self.first_token_ns().map(ms)
    }

    /// When it completed or failed at the client (ms).
    pub fn end_ms(&self) -> Option<f64> {
        self.end_ns().map(ms)
    }

    /// Queue time (ms): first scheduled − arrival (front, ingress, waiting queue and
    /// routing, until a rank scheduled it).
    pub fn queue_ms(&self) -> Option<f64> {
        self.first_scheduled_ms()
            .map(|s| (s - self.arrival_ms()).max(0.0))
    }

    /// Its wait at the serving front door for a process (ms; part of `queue_ms` and TTFT).
    pub fn front_queue_ms(&self) -> f64 {
        ms(self.front_queue_ns)
    }

    /// Its service at the front door (ms; part of `queue_ms` and TTFT).
    pub fn front_service_ms(&self) -> f64 {
        ms(self.front_service_ns)
    }

    /// TTFT (ms), when a token arrived.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_ms().map(|t| t - self.arrival_ms())
    }

    /// End to end (ms), when it ended.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.end_ms().map(|t| t - self.arrival_ms())
    }

    /// TPOT (ms): 0 with one output token, as vLLM counts it for goodput.
    pub fn tpot_ms(&self) -> Option<f64> {
        let (first, end) = (self.first_token_ms()?, self.end_ms()?);
        Some(if self.output_tokens > 1 {
            (end - first) / f64::from(self.output_tokens - 1)
        } else {
            0.0
        })
    }
}

impl PartialEq for RequestDetail {
    fn eq(&self, other: &RequestDetail) -> bool {
        self.id == other.id
            && self.output_tokens == other.output_tokens
            && self.token_digest == other.token_digest
            && self.failure == other.failure
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// A time the JSON gives in ms back in ns (exact for what [`ms`] wrote, below 2^53 ns).
fn ns(ms: f64) -> u64 {
    (ms * 1e6).round().max(0.0) as u64
}

/// The JSON form of [`RequestDetail`] (and of `per_request` before it was compacted).
#[derive(Serialize, Deserialize)]
struct RequestDetailJson {
    id: u64,
    output_tokens: u32,
    /// Hex.
    token_digest: String,
    failure: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure_kind: Option<FailureKind>,
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    arrival_ms: f64,
    #[serde(default)]
    first_scheduled_ms: Option<f64>,
    #[serde(default)]
    first_token_ms: Option<f64>,
    #[serde(default)]
    end_ms: Option<f64>,
    /// Derived (`first_scheduled_ms - arrival_ms`); written for readers, not read.
    #[serde(default)]
    queue_ms: Option<f64>,
    #[serde(default)]
    front_queue_ms: f64,
    #[serde(default)]
    front_service_ms: f64,
}

impl From<RequestDetail> for RequestDetailJson {
    fn from(d: RequestDetail) -> RequestDetailJson {
        RequestDetailJson {
            id: d.id,
            output_tokens: d.output_tokens,
            token_digest: d.token_digest_hex(),
            failure: d.failure().map(String::from),
            failure_kind: d.failure_kind(),
            prompt_tokens: d.prompt_tokens,
            arrival_ms: d.arrival_ms(),
            first_scheduled_ms: d.first_scheduled_ms(),
            first_token_ms: d.first_token_ms(),
            end_ms: d.end_ms(),
            queue_ms: d.queue_ms(),
            front_queue_ms: d.front_queue_ms(),
            front_service_ms: d.front_service_ms(),
        }
    }
}

impl From<RequestDetailJson> for RequestDetail {
    fn from(j: RequestDetailJson) -> RequestDetail {
        RequestDetail {
            id: j.id,
            prompt_tokens: j.prompt_tokens,
            output_tokens: j.output_tokens,
            arrival_ns: ns(j.arrival_ms),
            last_token_ns: 0,
            // A digest that is not hex (none in reports lockstep writes) reads as 0.
            token_digest: u64::from_str_radix(&j.token_digest, 16).unwrap_or(0),
            front_queue_ns: ns(j.front_queue_ms),
            front_service_ns: ns(j.front_service_ms),
            first_scheduled_ns: MaybeNs::of(j.first_scheduled_ms.map(ns)),
            first_token_ns: MaybeNs::of(j.first_token_ms.map(ns)),
            end_ns: MaybeNs::of(j.end_ms.map(ns)),
            failure: j.failure.map(|why| {
                Box::new(Failed {
                    kind: j.failure_kind,
                    why,
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_compact() {
        assert_eq!(std::mem::size_of::<RequestDetail>(), 88);
    }

    #[test]
    fn json_round_trips_to_the_same_text() {
        let mut d = RequestDetail::new(7, 120, 1_234_567_891);
        d.output_tokens = 3;
        d.token_digest = 0xdead_beef_0012_3456;
        d.front_queue_ns = 5;
        d.scheduled_at(2_000_000_001);
        d.scheduled_at(1_999_999_999);
        d.set_first_token_ns(Some(3_000_000_000_123));
        d.end(
            4_000_000_000_777,
            Some((FailureKind::Cancelled, "cut".into())),
        );
        let text = serde_json::to_string(&d).unwrap();
        assert!(
            text.contains(r#""token_digest":"deadbeef00123456""#),
            "{text}"
        );
        assert!(
            text.contains(r#""first_scheduled_ms":1999.999999"#),
            "{text}"
        );
        assert!(text.contains(r#""queue_ms":765.432108"#), "{text}");
        let back: RequestDetail = serde_json::from_str(&text).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), text);
        assert_eq!(back.first_token_ns(), Some(3_000_000_000_123));
        assert_eq!(back.failure_kind(), Some(FailureKind::Cancelled));
        assert!(!back.completed());
    }

    #[test]
    fn a_request_ends_once() {
        let mut d = RequestDetail::new(1, 1, 0);
        assert!(!d.completed());
        d.end(5, None);
        d.end(9, Some((FailureKind::Cancelled, "late".into())));
        assert!(d.completed());
        assert_eq!((d.end_ns(), d.failure()), (Some(5), None));
    }
}
