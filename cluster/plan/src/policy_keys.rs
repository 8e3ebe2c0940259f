//! The policy's TOML keys: the `[policy]` table of a scenario and `--set policy.KEY=VALUE`
//! name switches of [`Policy`] by dotted key. Parsing lives here, with the layer that
//! loads scenarios; the actors only receive the resulting [`Policy`].

use lockstep_actors::policy::{IdlePredicate, PadPredicate, Policy, PolicyPreset};

/// A policy key that does not exist, or a value of the wrong kind.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("policy key `{key}`: {message}")]
pub struct PolicyKeyError {
    /// The key.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

/// Applies `preset` and then dotted overrides (`pad.rollback = false`) to a policy.
/// Used by the `[policy]` table and by `--set policy.KEY=VALUE`.
pub fn policy_from_table(table: &toml::Table) -> Result<Policy, PolicyKeyError> {
    let mut policy = match table.get("preset") {
        None => Policy::FIXED,
        Some(v) => {
            let preset: PolicyPreset = v.clone().try_into().map_err(|_| PolicyKeyError {
                key: "preset".into(),
                message: format!("expected \"fixed\" or \"legacy\", got {v}"),
            })?;
            Policy::preset(preset)
        }
    };
    let mut flat = Vec::new();
    flatten("", table, &mut flat);
    for (key, value) in flat {
        if key == "preset" {
            continue;
        }
        set_policy_key(&mut policy, &key, &value)?;
    }
    Ok(policy)
}

/// The leaves of `table` under their dotted keys (`[pad] rollback` is `pad.rollback`).
fn flatten(prefix: &str, table: &toml::Table, out: &mut Vec<(String, toml::Value)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            other => out.push((key, other.clone())),
        }
    }
}

/// Sets one switch by its dotted name. Unknown keys and wrong kinds name the key.
pub fn set_policy_key(
    policy: &mut Policy,
    key: &str,
    value: &toml::Value,
) -> Result<(), PolicyKeyError> {
    let want_bool = |v: &toml::Value| {
        v.as_bool().ok_or_else(|| PolicyKeyError {
            key: key.to_string(),
            message: format!("expected true or false, got {v}"),
        })
    };
    match key {
        "admission.charge_retiring" => policy.admission.charge_retiring = want_bool(value)?,
        "seats.rederive" => policy.seats.rederive = want_bool(value)?,
        "pad.rollback" => policy.pad.rollback = want_bool(value)?,
        "gne.count_transfers_as_requests" => {
            policy.gne.count_transfers_as_requests = want_bool(value)?
        }
        "pad.predicate" => {
            policy.pad.predicate = match value.as_str() {
                Some("fixed") => PadPredicate::Fixed,
                Some("legacy") => PadPredicate::Legacy,
                _ => {
                    return Err(PolicyKeyError {
                        key: key.to_string(),
                        message: format!("expected \"fixed\" or \"legacy\", got {value}"),
                    });
                }
            }
        }
        "idle.predicate" => {
            policy.idle.predicate = match value.as_str() {
                Some("live") => IdlePredicate::Live,
                Some("routable") => IdlePredicate::Routable,
                _ => {
                    return Err(PolicyKeyError {
                        key: key.to_string(),
                        message: format!("expected \"live\" or \"routable\", got {value}"),
                    });
                }
            }
        }
        _ => {
            return Err(PolicyKeyError {
                key: key.to_string(),
                message: "unknown policy switch (known: preset, admission.charge_retiring, \
                          seats.rederive, pad.predicate, pad.rollback, \
                          gne.count_transfers_as_requests, idle.predicate)"
                    .into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_preset_then_dotted_overrides_make_the_policy() {
        let p = policy_from_table(&table("preset = \"legacy\"\n[pad]\nrollback = true\n"));
        let mut want = Policy::LEGACY;
        want.pad.rollback = true;
        assert_eq!(p, Ok(want));
        assert_eq!(policy_from_table(&toml::Table::new()), Ok(Policy::FIXED));
    }

    #[test]
    fn refusals_name_the_key_and_what_was_expected() {
        let message = |text: &str| policy_from_table(&table(text)).unwrap_err().to_string();
        assert_eq!(
            message("preset = \"strict\""),
            "policy key `preset`: expected \"fixed\" or \"legacy\", got \"strict\""
        );
        assert_eq!(
            message("[pad]\nrollback = 1"),
            "policy key `pad.rollback`: expected true or false, got 1"
        );
        assert_eq!(
            message("[idle]\npredicate = \"never\""),
            "policy key `idle.predicate`: expected \"live\" or \"routable\", got \"never\""
        );
        assert!(
            message("[pad]\nrollbak = true")
                .starts_with("policy key `pad.rollbak`: unknown policy switch (known: preset,")
        );
    }
}
