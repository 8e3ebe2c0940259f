//! Every control-plane switch in one struct, with the `fixed` and `legacy` presets.
//!
//! A switch's legacy value reproduces a historical defect (mechanisms.md) so that a user
//! can A/B the control plane. The default is `fixed`.

use serde::{Deserialize, Serialize};

/// All switches. TOML: a `[policy]` table with `preset = "fixed" | "legacy"` and dotted
/// overrides such as `pad.rollback = false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// §2 admission.
    pub admission: AdmissionPolicy,
    /// §7 seats.
    pub seats: SeatsPolicy,
    /// §6 padding.
    pub pad: PadPolicy,
    /// §4 GUARANTEED_NO_EVICT.
    pub gne: GnePolicy,
    /// §3.2 the idle decision.
    pub idle: IdlePolicy,
}

/// §2 switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionPolicy {
    /// Legacy `true`: routable = live (retiring requests charged against admission) and
    /// the capacity scheduler's window ends at GENERATION_COMPLETE.
    pub charge_retiring: bool,
}

/// §7 switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SeatsPolicy {
    /// Legacy `true`: the KV index pool re-derives its size as `pp*B + 1` instead of
    /// receiving the seats; the validator only warns.
    pub rederive: bool,
}

/// Which schedulable predicate the padding decision uses (§6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PadPredicate {
    /// The scheduler's published window and readiness.
    #[default]
    Fixed,
    /// Also counts GENERATION_TO_COMPLETE and transfer states as schedulable.
    Legacy,
}

/// §6 switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PadPolicy {
    /// The need predicate.
    pub predicate: PadPredicate,
    /// Fixed `true`: a dummy of a rejected iteration is rolled back. Legacy `false`: it
    /// survives into the next iteration.
    pub rollback: bool,
}

/// §4 switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GnePolicy {
    /// Legacy `true`: DISAGG_GENERATION_TRANS_IN_PROGRESS requests count toward the
    /// capacity scheduler's request cap.
    pub count_transfers_as_requests: bool,
}

/// Which count the idle decision reads (§3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum IdlePredicate {
    /// Σ live: retiring requests keep the server busy.
    #[default]
    Live,
    /// Σ routable: retiring requests ignored, so rank 0 waits for new input while a
    /// retiring request needs one more iteration.
    Routable,
}

/// §3.2 switch. Not part of the `legacy` preset: under a closed-loop client it is a
/// deadlock, not a cost to measure (the stall bound turns it into failed requests). It
/// exists so that the deadlock can be shown on the shipped code (the loom model's
/// negative control and the drivers' deadlock tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdlePolicy {
    /// The count that must be zero for rank 0 to wait for input.
    pub predicate: IdlePredicate,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        Policy::FIXED.idle
    }
}
impl Default for AdmissionPolicy {
    fn default() -> Self {
        Policy::FIXED.admission
    }
}
impl Default for SeatsPolicy {
    fn default() -> Self {
        Policy::FIXED.seats
    }
}
impl Default for PadPolicy {
    fn default() -> Self {
        Policy::FIXED.pad
    }
}
impl Default for GnePolicy {
    fn default() -> Self {
        Policy::FIXED.gne
    }
}
impl Default for Policy {
    fn default() -> Self {
        Policy::FIXED
    }
}

/// A named preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyPreset {
    /// Every defect fixed (the default).
    #[default]
    Fixed,
    /// All five historical behaviours on.
    Legacy,
}

impl Policy {
    /// Every defect fixed.
    pub const FIXED: Policy = Policy {
        admission: AdmissionPolicy {
            charge_retiring: false,
        },
        seats: SeatsPolicy { rederive: false },
        pad: PadPolicy {
            predicate: PadPredicate::Fixed,
            rollback: true,
        },
        gne: GnePolicy {
            count_transfers_as_requests: false,
        },
        idle: IdlePolicy {
            predicate: IdlePredicate::Live,
        },
    };

    /// All five historical behaviours on.
    pub const LEGACY: Policy = Policy {
        admission: AdmissionPolicy {
            charge_retiring: true,
        },
        seats: SeatsPolicy { rederive: true },
        pad: PadPolicy {
            predicate: PadPredicate::Legacy,
            rollback: false,
        },
        gne: GnePolicy {
            count_transfers_as_requests: true,
        },
        // A deadlock, not a cost: see [`IdlePolicy`].
        idle: IdlePolicy {
            predicate: IdlePredicate::Live,
        },
    };

    /// The preset's switches.
    pub fn preset(preset: PolicyPreset) -> Policy {
        match preset {
            PolicyPreset::Fixed => Policy::FIXED,
            PolicyPreset::Legacy => Policy::LEGACY,
        }
    }

    /// The names of the switches whose value differs from `fixed`, for reports.
    pub fn legacy_switches(&self) -> Vec<&'static str> {
        let mut on = Vec::new();
        if self.admission.charge_retiring {
            on.push("admission.charge_retiring");
        }
        if self.seats.rederive {
            on.push("seats.rederive");
        }
        if self.pad.predicate == PadPredicate::Legacy {
            on.push("pad.predicate");
        }
        if !self.pad.rollback {
            on.push("pad.rollback");
        }
        if self.gne.count_transfers_as_requests {
            on.push("gne.count_transfers_as_requests");
        }
        if self.idle.predicate == IdlePredicate::Routable {
            on.push("idle.predicate");
        }
        on
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_preset_turns_on_all_five_switches() {
        assert_eq!(Policy::LEGACY.legacy_switches().len(), 5);
        assert!(!Policy::LEGACY.legacy_switches().contains(&"idle.predicate"));
        assert!(Policy::FIXED.legacy_switches().is_empty());
        assert_eq!(Policy::default(), Policy::FIXED);
    }
}
