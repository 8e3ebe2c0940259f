//! A scenario file: servers, policy and (with the simulator) workload and model. Parsing
//! names the offending key; every derived size comes from `ServerConfig::derive`.

use serde::{Deserialize, Serialize};

use lockstep_actors::config::{ConfigError, Derived, ServerConfig};
use lockstep_actors::policy::Policy;

use crate::frontend::FrontendConfig;
use crate::model::ModelConfig;
use crate::policy_keys::{PolicyKeyError, policy_from_table, set_policy_key};
use crate::workload::WorkloadConfig;

/// An error loading a scenario.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario `{path}`: {source}")]
    Read {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// TOML syntax or an unknown key / wrong type (the parser's message names the key).
    #[error("{0}")]
    Parse(String),
    /// A config error (names the key and value).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A `[policy]` or `--set policy.` key that does not exist, or a value of the wrong
    /// kind.
    #[error(transparent)]
    PolicyKey(#[from] PolicyKeyError),
    /// A `--set KEY=VALUE` that cannot be applied.
    #[error("--set {assignment}: {message}")]
    Set {
        /// The assignment as given.
        assignment: String,
        /// What is wrong.
        message: String,
    },
    /// No `[[server]]` table.
    #[error("scenario: no [[server]] table: a scenario needs at least one server")]
    NoServer,
    /// Two servers share a name.
    #[error("scenario: two servers are named `{0}`; names must be unique")]
    DuplicateServer(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    policy: Option<toml::Table>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    server: Vec<ServerConfig>,
    #[serde(default)]
    workload: Option<WorkloadConfig>,
    #[serde(default)]
    model: ModelConfig,
    #[serde(default)]
    faults: Faults,
    #[serde(default)]
    front: FrontConfig,
    #[serde(default)]
    frontend: FrontendConfig,
}

pub use lockstep_actors::front::FrontPolicy;

/// `[front]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontConfig {
    /// Server selection policy.
    #[serde(default)]
    pub policy: FrontPolicy,
}

/// `[faults]`: deterministic fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// The KV of every request whose id is a multiple of n is lost on the wire: only
    /// its timeout (`cache_transceiver_config.kv_transfer_timeout_ms`) ends the
    /// transfer. Keyed by the request, so every driver loses the same ones.
    #[serde(default)]
    pub lost_transfer_every: Option<u64>,
    /// Simulator only: the lost transfers' timeouts are lost too (a transceiver that
    /// never reports): the run can then only end `deadlocked`, which this exercises.
    #[serde(default)]
    pub timeouts_lost: bool,
}

/// A loaded scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Name (defaults to the file stem).
    pub name: String,
    /// Free text.
    pub description: Option<String>,
    /// The policy after preset and overrides.
    pub policy: Policy,
    /// Servers in file order.
    pub servers: Vec<ServerConfig>,
    /// `[workload]` (required by `sim`).
    pub workload: Option<WorkloadConfig>,
    /// `[model]`.
    pub model: ModelConfig,
    /// `[faults]`.
    pub faults: Faults,
    /// `[front]`.
    pub front: FrontConfig,
    /// `[frontend]`: the serving front door's costs.
    pub frontend: FrontendConfig,
    /// Seed given in the file (overrides `--seed`).
    pub seed: Option<u64>,
    /// The folder relative trace paths are resolved against.
    pub base_dir: std::path::PathBuf,
}

impl Scenario {
    /// Parses scenario text. `name` is used when the file has none.
    pub fn parse(text: &str, name: &str) -> Result<Scenario, ScenarioError> {
        let raw: RawScenario =
            toml::from_str(text).map_err(|e| ScenarioError::Parse(e.to_string()))?;
        let policy = match &raw.policy {
            Some(t) => policy_from_table(t)?,
            None => Policy::FIXED,
        };
        if raw.server.is_empty() {
            return Err(ScenarioError::NoServer);
        }
        let mut names: Vec<&str> = raw.server.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ScenarioError::DuplicateServer(w[0].to_string()));
        }
        Ok(Scenario {
            name: raw.name.unwrap_or_else(|| name.to_string()),
            description: raw.description,
            policy,
            servers: raw.server,
            workload: raw.workload,
            model: raw.model,
            faults: raw.faults,
            front: raw.front,
            frontend: raw.frontend,
            seed: raw.seed,
            base_dir: std::path::PathBuf::from("."),
        })
    }

    /// Reads and parses a scenario file.
    pub fn load(path: &std::path::Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "scenario".into());
        let mut s = Scenario::parse(&text, &stem)?;
        s.base_dir = path
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_else(|| std::path::PathBuf::from("."));
        Ok(s)
    }

    /// Applies `--set KEY=VALUE`: `policy.<switch>=...`, `policy.preset=fixed|legacy`,
    /// `server.<name>.<key>=...` / `server.<key>=...` (all servers), or a key of
    /// `[workload]`, `[model]`, `[faults]`, `[front]` or `[frontend]`.
    pub fn apply_set(&mut self, assignment: &str) -> Result<(), ScenarioError> {
        let err = |message: String| ScenarioError::Set {
            assignment: assignment.to_string(),
            message,
        };
        let (key, value) = assignment
            .split_once('=')
            .ok_or_else(|| err("expected KEY=VALUE".into()))?;
        let value = parse_value(value.trim());
        let key = key.trim();
        if let Some(switch) = key.strip_prefix("policy.") {
            if switch == "preset" {
                let mut t = toml::Table::new();
                t.insert("preset".into(), value);
                self.policy = policy_from_table(&t)?;
            } else {
                set_policy_key(&mut self.policy, switch, &value)?;
            }
            return Ok(());
        }
        if let Some(rest) = key.strip_prefix("server.") {
            let (targets, field): (Vec<usize>, &str) = match rest.split_once('.') {
                Some((name, field)) if self.servers.iter().any(|s| s.name == name) => (
                    self.servers
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.name == name)
                        .map(|(i, _)| i)
                        .collect(),
                    field,
                ),
                _ => ((0..self.servers.len()).collect(), rest),
            };
            for i in targets {
                let server = &self.servers[i];
                let mut table = toml::Table::try_from(server)
                    .map_err(|e| err(format!("cannot re-encode server: {e}")))?;
                insert_dotted(&mut table, field, value.clone());
                let updated: ServerConfig = toml::Value::Table(table)
                    .try_into()
                    .map_err(|e: toml::de::Error| err(e.to_string()))?;
                self.servers[i] = updated;
            }
            return Ok(());
        }
        if let Some(field) = key.strip_prefix("workload.") {
            let wl = self
                .workload
                .as_ref()
                .ok_or_else(|| err("the scenario has no [workload] section".into()))?;
            let mut table = toml::Table::try_from(wl)
                .map_err(|e| err(format!("cannot re-encode workload: {e}")))?;
            insert_dotted(&mut table, field, value);
            self.workload = Some(
                toml::Value::Table(table)
                    .try_into()
                    .map_err(|e: toml::de::Error| err(e.to_string()))?,
            );
            return Ok(());
        }
        if let Some(field) = key.strip_prefix("model.") {
            let mut table = toml::Table::try_from(&self.model)
                .map_err(|e| err(format!("cannot re-encode model: {e}")))?;
            insert_dotted(&mut table, field, value);
            self.model = toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| err(e.to_string()))?;
            return Ok(());
        }
        if let Some(field) = key.strip_prefix("faults.") {
            self.faults = with_field(&self.faults, field, value).map_err(err)?;
            return Ok(());
        }
        if let Some(field) = key.strip_prefix("front.") {
            self.front = with_field(&self.front, field, value).map_err(err)?;
            return Ok(());
        }
        if let Some(field) = key.strip_prefix("frontend.") {
            self.frontend = with_field(&self.frontend, field, value).map_err(err)?;
            return Ok(());
        }
        Err(err(
            "keys start with `policy.`, `server.`, `workload.`, `model.`, `faults.`, `front.` or `frontend.` (e.g. policy.pad.rollback=false, server.max_batch_size=4)"
                .into(),
        ))
    }

    /// Derives every server's sizes; the first error stops.
    pub fn derive_all(&self) -> Result<Vec<Derived>, ScenarioError> {
        self.servers
            .iter()
            .map(|s| s.derive(&self.policy).map_err(ScenarioError::from))
            .collect()
    }
}

fn parse_value(text: &str) -> toml::Value {
    let wrapped = format!("v = {text}");
    match wrapped.parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(text.into())),
        Err(_) => toml::Value::String(text.into()),
    }
}

/// `section` with the dotted `field` set to `value`, re-read so every check of the
/// section applies; the error names what was wrong.
fn with_field<T: Serialize + serde::de::DeserializeOwned>(
    section: &T,
    field: &str,
    value: toml::Value,
) -> Result<T, String> {
    let mut table = toml::Table::try_from(section).map_err(|e| format!("cannot re-encode: {e}"))?;
    insert_dotted(&mut table, field, value);
    toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| e.to_string())
}

fn insert_dotted(table: &mut toml::Table, key: &str, value: toml::Value) {
    match key.split_once('.') {
        None => {
            table.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = table
                .entry(head.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            if let toml::Value::Table(t) = entry {
                insert_dotted(t, rest, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = r#"
[[server]]
name = "agg0"
tensor_parallel_size = 2
max_batch_size = 2
"#;

    #[test]
    fn unknown_key_is_rejected_by_name() {
        let text = format!("{ONE}max_batch_sise = 3\n");
        let e = Scenario::parse(&text, "t").unwrap_err().to_string();
        assert!(e.contains("max_batch_sise"), "{e}");
    }

    #[test]
    fn zero_and_negative_sizes_name_the_field_and_value() {
        for (key, value) in [("max_batch_size", "0"), ("max_num_tokens", "-5")] {
            let text = format!("[[server]]\nname = \"s\"\n{key} = {value}\n");
            let s = Scenario::parse(&text, "t").unwrap();
            let e = s.derive_all().unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(value), "{e}");
        }
    }

    #[test]
    fn tensor_parallel_size_must_match_the_ranks() {
        let text = format!("{ONE}ranks = 4\n");
        let e = Scenario::parse(&text, "t")
            .unwrap()
            .derive_all()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor_parallel_size (2)") && e.contains("ranks = 4"),
            "{e}"
        );
    }

    #[test]
    fn set_overrides_policy_and_server_keys() {
        let mut s = Scenario::parse(ONE, "t").unwrap();
        s.apply_set("policy.pad.rollback=false").unwrap();
        assert!(!s.policy.pad.rollback);
        s.apply_set("policy.preset=legacy").unwrap();
        assert_eq!(s.policy, Policy::LEGACY);
        s.apply_set("server.max_batch_size=7").unwrap();
        assert_eq!(s.servers[0].max_batch_size, 7);
        s.apply_set("server.agg0.kv_cache_config.tokens_per_block=64")
            .unwrap();
        assert_eq!(s.servers[0].kv_cache_config.tokens_per_block, 64);
        let e = s.apply_set("server.no_such_key=1").unwrap_err().to_string();
        assert!(e.contains("no_such_key"), "{e}");
        let e = s
            .apply_set("policy.pad.rollbak=true")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pad.rollbak"), "{e}");
    }

    #[test]
    fn duplicate_server_names_are_rejected() {
        let text = format!("{ONE}{ONE}");
        let e = Scenario::parse(&text, "t").unwrap_err().to_string();
        assert!(e.contains("agg0"), "{e}");
    }
}
