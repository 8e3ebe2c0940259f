//! The stall bound, one rule for every driver's rank 0 (§3.2): a read of the ingress in
//! `FetchMode::Stalled` starts (or continues) a stall; a read in any other mode ends
//! it. A *bounded* stall — work remains and no transfer is in flight — that lasts the
//! bound without an input ends the server's work as deadlocked, with
//! [`StallTimer::reason`]. The simulator measures it in virtual time, the real drivers
//! in wall time.

use lockstep_actors::executor::FetchMode;

/// Rank 0's stall timer.
#[derive(Debug, Clone)]
pub struct StallTimer {
    bound_ns: u64,
    since: Option<u64>,
}

impl StallTimer {
    /// A timer whose bounded stalls end after `bound_ns`.
    pub fn new(bound_ns: u64) -> StallTimer {
        StallTimer {
            bound_ns,
            since: None,
        }
    }

    /// Rank 0 reads its ingress in `mode` at `now`: when the wait is a bounded stall,
    /// the time it ends as deadlocked (counted from the stall's start).
    pub fn on_read(&mut self, mode: FetchMode, now: u64) -> Option<u64> {
        match mode {
            FetchMode::Stalled { bounded } => {
                let since = *self.since.get_or_insert(now);
                bounded.then(|| since.saturating_add(self.bound_ns))
            }
            FetchMode::Poll | FetchMode::Block => {
                self.since = None;
                None
            }
        }
    }

    /// Why a bounded stall that lasted the bound ended the server's work.
    pub fn reason(&self) -> String {
        format!(
            "no iteration changed anything for {} ms while requests remained and no transfer was in flight",
            self.bound_ns / 1_000_000
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_stall_ends_a_bound_after_it_began_and_any_other_read_resets_it() {
        let mut t = StallTimer::new(1_000);
        assert_eq!(t.on_read(FetchMode::Stalled { bounded: false }, 10), None);
        // Still the same stall: counted from 10.
        assert_eq!(
            t.on_read(FetchMode::Stalled { bounded: true }, 500),
            Some(1_010)
        );
        assert_eq!(t.on_read(FetchMode::Poll, 600), None);
        // A new stall.
        assert_eq!(
            t.on_read(FetchMode::Stalled { bounded: true }, 700),
            Some(1_700)
        );
        assert_eq!(t.on_read(FetchMode::Block, 800), None);
        assert_eq!(
            t.on_read(FetchMode::Stalled { bounded: true }, 900),
            Some(1_900)
        );
        assert!(t.reason().contains("for 0 ms"), "{}", t.reason());
        assert!(
            StallTimer::new(10_000_000_000)
                .reason()
                .contains("10000 ms")
        );
    }
}
