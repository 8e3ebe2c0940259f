//! What every driver needs to know about a scenario before it runs: its servers and
//! their derived sizes, the roles (aggregated, or ctx and gen), one KV block size for
//! the fleet, the model profile, the front's configuration. One planner, so the
//! simulator and the real drivers refuse the same scenarios with the same words.

use lockstep_actors::config::{
    DerivedSizes, RequestShape, Role, ServerConfig, ServerLimits, Unservable, roles_needed,
    unservable,
};
use lockstep_actors::front::{FrontConfig, FrontServer};
use lockstep_actors::transceiver::{KvCodec, PeerMessage};
use lockstep_actors::vocab::KvAddress;
use lockstep_gpu::{AnalyticBackend, Coefficients, ModelProfile, kv_contents};

use crate::model::ModelError;
use crate::scenario::{Scenario, ScenarioError};
use crate::workload::{Workload, WorkloadError};

/// Block hashes the front remembers per server for `kv_aware` selection.
pub const FRONT_PREFIX_MEMORY: usize = 65_536;

/// A scenario a driver cannot run.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A server's configuration is invalid.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// The `[model]` section is invalid.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The `[workload]` section is invalid.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The scenario has no `[workload]`.
    #[error("the scenario has no [workload] section")]
    NoWorkload,
    /// A scenario value out of range.
    #[error("{key}: {message}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong, with the value.
        message: String,
    },
    /// No request the workload can produce could ever be served.
    #[error("no request of this workload could ever be served: {why}")]
    Unservable {
        /// The refusal of the first request, per server of the role that refused it.
        why: Unservable,
    },
    /// Aggregated and disaggregated servers mixed.
    #[error(
        "a scenario has either agg servers or ctx and gen servers, not both (server `{agg}` is agg, server `{other}` is {role})"
    )]
    MixedRoles {
        /// An agg server.
        agg: String,
        /// A ctx or gen server.
        other: String,
        /// Its role.
        role: &'static str,
    },
    /// ctx servers without gen servers or the other way round.
    #[error(
        "a disaggregated scenario needs at least one ctx and one gen server; it has {ctx} ctx and {gen_servers} gen"
    )]
    OneSided {
        /// ctx servers.
        ctx: usize,
        /// gen servers.
        gen_servers: usize,
    },
    /// Servers with different KV block sizes.
    #[error(
        "server `{server}`: kv_cache_config.tokens_per_block = {value} differs from server `{first}`'s {first_value}; KV handed between servers needs one block size"
    )]
    BlockSizes {
        /// The differing server.
        server: String,
        /// Its block size.
        value: u32,
        /// The first server.
        first: String,
        /// Its block size.
        first_value: u32,
    },
    /// A simulator-only fault under a real driver.
    #[error("faults.timeouts_lost is a simulator-only fault: a real transceiver always times out")]
    SimulatorOnlyFault,
}

/// One server, ready to run.
#[derive(Debug, Clone)]
pub struct PlannedServer<'s> {
    /// Its configuration.
    pub config: &'s ServerConfig,
    /// Its sizes.
    pub sizes: DerivedSizes,
    /// The startup warning under legacy `seats.rederive`.
    pub warning: Option<String>,
    /// Its ranks' cost model: the fleet's, or its own (`[model.servers.NAME]`).
    pub coefficients: Coefficients,
}

impl PlannedServer<'_> {
    /// What this server can run (the ranks' and the front's rule).
    pub fn limits(&self) -> ServerLimits {
        ServerLimits::of(self.config, &self.sizes)
    }

    /// `kv_transfer_timeout_ms`, at least 1.
    pub fn transfer_timeout_ms(&self) -> u64 {
        self.config
            .cache_transceiver_config
            .kv_transfer_timeout_ms
            .max(1) as u64
    }

    /// `kv_pull_timeout_ms`, at least 1.
    pub fn pull_timeout_ms(&self) -> u64 {
        self.config
            .cache_transceiver_config
            .kv_pull_timeout_ms
            .max(1) as u64
    }

    /// The transceiver of this server's rank at `me`, with the server's timeouts (every
    /// driver builds it here).
    pub fn transceiver(
        &self,
        me: KvAddress,
        codec: lockstep_actors::transceiver::KvCodec,
    ) -> lockstep_actors::transceiver::Transceiver {
        lockstep_actors::transceiver::Transceiver::new(me, self.transfer_timeout_ms(), codec)
            .with_pull_timeout_ms(self.pull_timeout_ms())
    }
}

/// A server's cost model before `[model]` is resolved (never returned).
const UNRESOLVED: Coefficients = Coefficients {
    forward_base_ns: 0.0,
    ctx_token_ns: 0.0,
    ctx_attention_ns: 0.0,
    gen_request_ns: 0.0,
    gen_token_ns: 0.0,
    kv_read_ns: 0.0,
    collective_ns: 0.0,
    host_base_ns: 0.0,
    host_per_request_ns: 0.0,
};

/// A scenario planned for a run.
#[derive(Debug, Clone)]
pub struct Fleet<'s> {
    /// The scenario.
    pub scenario: &'s Scenario,
    /// Its servers, in scenario order.
    pub servers: Vec<PlannedServer<'s>>,
    /// The model profile (overrides applied).
    pub profile: ModelProfile,
    /// The fleet's KV block size.
    pub tokens_per_block: u32,
    /// The run's seed (a seed in the scenario wins).
    pub seed: u64,
}

impl<'s> Fleet<'s> {
    /// Checks the scenario and derives every server's sizes.
    pub fn plan(scenario: &'s Scenario, seed: u64) -> Result<Fleet<'s>, PlanError> {
        let mut servers = Vec::with_capacity(scenario.servers.len());
        for config in &scenario.servers {
            let derived = config
                .derive(&scenario.policy)
                .map_err(|e| PlanError::Scenario(ScenarioError::Config(e)))?;
            servers.push(PlannedServer {
                config,
                sizes: derived.sizes,
                warning: derived.warning,
                // Set below, once the model is resolved.
                coefficients: UNRESOLVED,
            });
        }
        if servers.is_empty() {
            return Err(PlanError::Scenario(ScenarioError::NoServer));
        }
        if scenario.faults.lost_transfer_every == Some(0) {
            return Err(PlanError::Invalid {
                key: "faults.lost_transfer_every",
                message: "must be at least 1 (the KV of every n-th request is lost), got 0".into(),
            });
        }
        let agg = scenario.servers.iter().find(|s| s.role == Role::Agg);
        let other = scenario.servers.iter().find(|s| s.role != Role::Agg);
        if let (Some(a), Some(o)) = (agg, other) {
            return Err(PlanError::MixedRoles {
                agg: a.name.clone(),
                other: o.name.clone(),
                role: o.role.name(),
            });
        }
        let count = |r| scenario.servers.iter().filter(|s| s.role == r).count();
        let (ctx, gen_servers) = (count(Role::Ctx), count(Role::Gen));
        if agg.is_none() && (ctx == 0 || gen_servers == 0) {
            return Err(PlanError::OneSided { ctx, gen_servers });
        }
        let first = &servers[0];
        if let Some(p) = servers
            .iter()
            .find(|p| p.sizes.tokens_per_block != first.sizes.tokens_per_block)
        {
            return Err(PlanError::BlockSizes {
                server: p.config.name.clone(),
                value: p.sizes.tokens_per_block,
                first: first.config.name.clone(),
                first_value: first.sizes.tokens_per_block,
            });
        }
        let tokens_per_block = first.sizes.tokens_per_block;
        let profile = scenario.model.resolve(&scenario.base_dir)?;
        if let Some(name) = scenario
            .model
            .servers
            .keys()
            .find(|n| !scenario.servers.iter().any(|s| &s.name == *n))
        {
            return Err(PlanError::Invalid {
                key: "model.servers",
                message: format!("`{name}` names no server of the scenario"),
            });
        }
        for p in &mut servers {
            p.coefficients = if scenario.model.servers.contains_key(&p.config.name) {
                scenario
                    .model
                    .resolve_server(&p.config.name, &scenario.base_dir)?
                    .coefficients
            } else {
                profile.coefficients
            };
        }
        Ok(Fleet {
            scenario,
            servers,
            profile,
            tokens_per_block,
            seed: scenario.seed.unwrap_or(seed),
        })
    }

    /// Server `s`'s cost model.
    pub fn backend(&self, s: usize) -> AnalyticBackend {
        AnalyticBackend::new(self.servers[s].coefficients)
    }

    /// Refuses what only the simulator can model.
    pub fn check_real(&self) -> Result<(), PlanError> {
        if self.scenario.faults.timeouts_lost {
            return Err(PlanError::SimulatorOnlyFault);
        }
        Ok(())
    }

    /// The workload, seeded; refused if none of its requests could ever be served (a
    /// run that could only fail every request is a configuration error, not a result).
    pub fn workload(&self) -> Result<Workload, PlanError> {
        let cfg = self
            .scenario
            .workload
            .as_ref()
            .ok_or(PlanError::NoWorkload)?;
        let w = Workload::new(
            cfg,
            self.tokens_per_block,
            self.seed,
            &self.scenario.base_dir,
        )?;
        let check = self.shape_check();
        let mut first_refusal = None;
        let mut servable = false;
        for (prompt_len, max_new_tokens) in w.request_shapes() {
            match check.refusal(RequestShape {
                prompt_len,
                max_new_tokens,
                draft_len: 0,
                pinned_rank: None,
            }) {
                None => {
                    servable = true;
                    break;
                }
                Some(why) => {
                    first_refusal.get_or_insert(why);
                }
            }
        }
        match first_refusal {
            Some(why) if !servable => Err(PlanError::Unservable { why }),
            _ => Ok(w),
        }
    }

    /// The sizes rule of every server, owned: `lockstep serve` refuses a request no
    /// server could ever run before it reaches the front (400, naming the limit).
    pub fn shape_check(&self) -> ShapeCheck {
        ShapeCheck {
            disaggregated: self.disaggregated(),
            servers: self
                .servers
                .iter()
                .map(|p| ServerShape {
                    name: p.config.name.clone(),
                    role: p.config.role,
                    limits: p.limits(),
                })
                .collect(),
        }
    }

    /// Whether the fleet is disaggregated (ctx and gen servers).
    pub fn disaggregated(&self) -> bool {
        self.servers.iter().any(|s| s.config.role != Role::Agg)
    }

    /// Ranks in all.
    pub fn ranks(&self) -> usize {
        self.servers.iter().map(|s| s.sizes.dp as usize).sum()
    }

    /// Every rank's address, server by server.
    pub fn addresses(&self) -> impl Iterator<Item = KvAddress> + '_ {
        self.servers.iter().enumerate().flat_map(|(s, p)| {
            (0..p.sizes.dp).map(move |r| KvAddress {
                server: s as u32,
                rank: lockstep_actors::ids::RankId(r),
            })
        })
    }

    /// The front's configuration.
    pub fn front_config(&self) -> FrontConfig {
        FrontConfig {
            policy: self.scenario.front.policy,
            servers: self
                .servers
                .iter()
                .map(|p| FrontServer {
                    name: p.config.name.clone(),
                    role: p.config.role,
                    generation_first: p.config.role == Role::Ctx
                        && p.config.cache_transceiver_config.generation_first,
                    limits: p.limits(),
                })
                .collect(),
            prefix_memory: FRONT_PREFIX_MEMORY,
        }
    }

    /// Real KV bytes on the wire (the real drivers): the model's block size, capped.
    pub fn real_codec(&self) -> KvCodec {
        KvCodec::Real {
            block_bytes: kv_contents::block_bytes(
                self.profile.kv.bytes_per_token(),
                self.tokens_per_block,
            ),
            model_block_bytes: self.profile.kv.bytes_per_token() * u64::from(self.tokens_per_block),
            fill: kv_contents::fill_block,
            checksum: kv_contents::checksum,
        }
    }

    /// The modeled wire of the real drivers when they run modeled time (`time_scale >
    /// 0`): what the simulator's network charges a message, scaled.
    pub fn wire_model(&self, time_scale: f64) -> Option<WireModel> {
        (time_scale > 0.0).then(|| WireModel {
            latency_ns: self.scenario.model.link.latency_us * 1_000.0,
            bytes_per_ns: self.scenario.model.link.bandwidth_gb_per_s,
            block_bytes: self.profile.kv.bytes_per_token() * u64::from(self.tokens_per_block),
            time_scale,
        })
    }

    /// Modeled KV (the simulator): the model's full block size, nothing materialised.
    pub fn modeled_codec(&self) -> KvCodec {
        KvCodec::Modeled {
            block_bytes: self.profile.kv.bytes_per_token() * u64::from(self.tokens_per_block),
        }
    }
}

/// One server's part of a [`ShapeCheck`].
#[derive(Debug, Clone)]
struct ServerShape {
    name: String,
    role: Role,
    limits: ServerLimits,
}

/// Whether the fleet could serve a request of a given shape: for every role it needs, a
/// server that can run it (the rule of [`ServerLimits::refusal`], which the front
/// routes by and the ranks apply when the request arrives).
#[derive(Debug, Clone)]
pub struct ShapeCheck {
    disaggregated: bool,
    servers: Vec<ServerShape>,
}

impl ShapeCheck {
    /// Why the fleet could never serve a request of this shape (the entry role, then
    /// for a disaggregated fleet the gen role), if it could not: every server of the
    /// first role none of whose servers can run it, with its limit.
    pub fn refusal(&self, r: RequestShape) -> Option<Unservable> {
        roles_needed(self.disaggregated, r.max_new_tokens)
            .iter()
            .find_map(|&role| {
                unservable(
                    role,
                    self.servers
                        .iter()
                        .map(|p| (p.name.as_str(), p.role, &p.limits)),
                    &r,
                )
            })
    }
}

/// Modeled time on the wire (the real drivers with modeled time): a peer's message is
/// handed to the transceiver only after the link's latency and its modeled size over
/// the link's bandwidth, scaled, as the simulator delivers it.
#[derive(Debug, Clone, Copy)]
pub struct WireModel {
    /// Link latency per message, ns.
    pub latency_ns: f64,
    /// Link bandwidth, bytes per ns.
    pub bytes_per_ns: f64,
    /// The model's bytes per KV block (real blocks on the wire are capped).
    pub block_bytes: u64,
    /// Wall seconds per modeled second.
    pub time_scale: f64,
}

impl WireModel {
    /// The scaled wall time `message` spends on the wire.
    pub fn delay_ns(&self, message: &PeerMessage) -> u64 {
        let modeled = match message {
            PeerMessage::KvBlocks { payload, .. } => {
                let blocks = u64::from(payload.blocks());
                64 + blocks * self.block_bytes
            }
            _ => 64,
        };
        self.scaled(modeled)
    }

    /// The scaled wall time a small message without payload spends on the link between
    /// two servers (a generation-first notice: the gen peer's answer to the ctx server).
    pub fn notice_ns(&self) -> u64 {
        self.scaled(64)
    }

    fn scaled(&self, bytes: u64) -> u64 {
        let ns = self.latency_ns + bytes as f64 / self.bytes_per_ns;
        (ns * self.time_scale).round() as u64
    }
}
