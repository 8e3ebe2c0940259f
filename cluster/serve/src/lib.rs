//! `lockstep serve`: an OpenAI-compatible HTTP server (actix-web on tokio) in front of
//! the threads driver's front host and servers, aggregated or disaggregated.
//!
//! The ranks stay on OS threads (their collectives block): the HTTP server runs on its
//! own thread with its own runtime, and a [`bridge`] on the caller's thread stands where
//! the workload client stands in `lockstep run`, between the handlers (a channel in)
//! and the front host (the same [`ClientItem`](lockstep_runtime::client::ClientItem)
//! channel and response channel the workload client uses).
//!
//! Shutdown: SIGTERM or Ctrl-C stops the server from accepting; in-flight requests are
//! answered (up to `drain_timeout`: those still running then are cut, each told so, and
//! counted in the summary); then the bridge sends the front the client's shutdown, the
//! servers drain and stop, and `serve` returns.

#![forbid(unsafe_code)]

pub use lockstep_openai as api;
pub mod api_key;
pub mod bridge;
pub mod http;
pub mod metrics;
pub mod model_text;
pub mod stop;
pub mod tokenize;

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use actix_web::{App, HttpServer, web};
use crossbeam_channel::unbounded;

use lockstep_plan::fleet::Fleet;
use lockstep_plan::report::RankSummary;
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;
use lockstep_runtime::client::ClientItem;
use lockstep_runtime::status::StatusBoard;
use lockstep_runtime::threads::{ClientPorts, plan, run_hosts};
use lockstep_runtime::{RuntimeError, WallClock};

/// How `lockstep serve` runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The address to bind (a name or an IP).
    pub host: String,
    /// The port (0: any free port; the bound address is announced).
    pub port: u16,
    /// The key `/v1/*` requires (`Authorization: Bearer KEY`), as
    /// [`api_key::resolve_api_key`] checked it.
    pub api_key: Option<String>,
    /// The served model's name (`/v1/models`, the `model` field).
    pub model: String,
    /// The largest request body, in bytes (413 past it).
    pub max_body_bytes: usize,
    /// The longest prompt, in tokens (400 past it).
    pub max_prompt_tokens: u32,
    /// vLLM's `--max-model-len`: the most prompt plus `max_tokens` tokens one request
    /// may take (400 `context_length_exceeded` past it); `None`: no such limit.
    pub max_model_len: Option<u32>,
    /// What the fleet's times are (`/v1/models` says so, so a benchmark can tell a
    /// server that models no time from one that does).
    pub time_base: lockstep_plan::report::TimeBase,
    /// How long a shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// HTTP worker threads.
    pub workers: usize,
    /// Requests accepted and not both ended and delivered past which a new one gets
    /// 429.
    pub max_pending: usize,
    /// How long a response may wait on a client that reads nothing before its
    /// connection is closed and its request cancelled.
    pub write_timeout: Duration,
    /// Output events a stream may have waiting for a client that reads nothing; one
    /// more cancels the request.
    pub stream_buffer: usize,
}

/// How long the HTTP server waits past the drain timeout for the requests cut then to
/// be answered, before it closes their connections.
const CUT_GRACE: Duration = Duration::from_secs(2);

/// Why `lockstep serve` could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a key.
    #[error(
        "--host {host}: {ip} is not a loopback address; serving beyond this machine needs an API key: --api-key-file PATH, the environment variable LOCKSTEP_API_KEY, or --api-key KEY (or bind 127.0.0.1)"
    )]
    OpenWithoutKey {
        /// As given.
        host: String,
        /// What it resolved to.
        ip: IpAddr,
    },
    /// The address does not resolve.
    #[error("--host {host}: cannot resolve it: {reason}")]
    BadHost {
        /// As given.
        host: String,
        /// Why.
        reason: String,
    },
    /// Binding failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The signal handler could not be set.
    #[error("setting the SIGTERM/Ctrl-C handler: {0}")]
    Signals(String),
    /// The HTTP server failed.
    #[error("the HTTP server: {0}")]
    Http(std::io::Error),
    /// The fleet failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// `--model` cannot serve text.
    #[error(transparent)]
    Model(#[from] lockstep_plan::model_backend::ModelBackendError),
}

/// `--model`'s text rules, when a model serves.
fn model_text_of(real: &RealOptions) -> Result<Option<Arc<model_text::ModelText>>, ServeError> {
    Ok(match &real.model {
        Some(m) => Some(Arc::new(model_text::ModelText::new(m)?)),
        None => None,
    })
}

/// What a serve run ended with.
pub struct ServeSummary {
    /// Requests taken.
    pub requests: u64,
    /// Answers cut at the drain timeout: requests still running then, and answers still
    /// being sent to their clients (the drain did not complete if any).
    pub cut: u64,
    /// Every rank's summary.
    pub ranks: Vec<RankSummary>,
}

/// Checks the address against the key rule (resolving it), without binding: what
/// `serve --driver mpi` checks before it starts mpirun.
pub fn check_address(opts: &ServeOptions) -> Result<SocketAddr, ServeError> {
    let addr = (opts.host.as_str(), opts.port)
        .to_socket_addrs()
        .map_err(|e| ServeError::BadHost {
            host: opts.host.clone(),
            reason: e.to_string(),
        })?
        .next()
        .ok_or_else(|| ServeError::BadHost {
            host: opts.host.clone(),
            reason: "no address".into(),
        })?;
    if !addr.ip().is_loopback() && opts.api_key.is_none() {
        return Err(ServeError::OpenWithoutKey {
            host: opts.host.clone(),
            ip: addr.ip(),
        });
    }
    Ok(addr)
}

/// Checks the address against the key rule and binds it.
pub fn bind(opts: &ServeOptions) -> Result<TcpListener, ServeError> {
    let addr = check_address(opts)?;
    TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })
}

/// The HTTP side of a serve run, started: the server on its own thread, and what the
/// bridge needs to stand in the client's place.
struct HttpSide {
    running: Running,
    bridge_rx: crossbeam_channel::Receiver<bridge::BridgeMsg>,
    metrics: metrics::Metrics,
}

/// The HTTP server, running.
struct Running {
    handle: actix_web::dev::ServerHandle,
    thread: std::thread::JoinHandle<std::io::Result<()>>,
    drain: Arc<http::Drain>,
}

impl HttpSide {
    /// Starts the HTTP server for `fleet` on `listener` (its ranks' status read from
    /// `board`), and the SIGTERM / Ctrl-C handler that stops it; `announce` gets the
    /// address once both are in place.
    fn start(
        fleet: &Fleet<'_>,
        opts: &ServeOptions,
        listener: TcpListener,
        board: StatusBoard,
        text: Option<Arc<model_text::ModelText>>,
        announce: impl FnOnce(SocketAddr),
    ) -> Result<HttpSide, ServeError> {
        let (bridge_tx, bridge_rx) = unbounded();
        let (metrics, registry) = metrics::Metrics::new(
            board,
            fleet
                .servers
                .iter()
                .map(|p| p.config.name.clone())
                .collect(),
        );
        let drain = Arc::new(http::Drain::default());
        let addr = listener.local_addr().map_err(ServeError::Http)?;
        let state = web::Data::new(http::AppState {
            bridge: bridge_tx.clone(),
            model: opts.model.clone(),
            api_key: opts.api_key.clone(),
            max_body_bytes: opts.max_body_bytes,
            max_prompt_tokens: opts.max_prompt_tokens,
            max_model_len: opts.max_model_len,
            time_base: opts.time_base,
            registry: Arc::new(registry),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(1),
            pending: metrics.pending.clone(),
            max_pending: opts.max_pending,
            write_timeout: opts.write_timeout,
            stalled: metrics.request_stalled.clone(),
            drain: drain.clone(),
            tokens_per_block: fleet.tokens_per_block,
            shapes: fleet.shape_check(),
            rejected: metrics.request_rejected.clone(),
            front_service: metrics.front_service.clone(),
            front_output: metrics.front_output.clone(),
            text,
        });
        let (handle_tx, handle_rx) = crossbeam_channel::bounded(1);
        let workers = opts.workers.max(1);
        // Past the drain timeout the requests still running are cut and answered so;
        // the server waits a little longer for those answers to go out.
        let shutdown_s = (opts.drain_timeout + CUT_GRACE).as_secs().max(1);
        let to_bridge = bridge_tx.clone();
        let thread = std::thread::Builder::new()
            .name("http".into())
            .spawn(move || {
                let result = actix_web::rt::System::new().block_on(async move {
                    let built = HttpServer::new(move || {
                        App::new()
                            .app_data(state.clone())
                            .configure(http::configure)
                    })
                    .on_connect(|connection, data| {
                        // Tokens go out as small writes: without TCP_NODELAY, Nagle's
                        // algorithm holds each behind the client's delayed ACK (~40 ms).
                        if let Some(tcp) =
                            connection.downcast_ref::<actix_web::rt::net::TcpStream>()
                        {
                            let _ = tcp.set_nodelay(true);
                        }
                        if let Some(peer) = http::Peer::of(connection) {
                            data.insert(peer);
                        }
                    })
                    .workers(workers)
                    .disable_signals()
                    .shutdown_timeout(shutdown_s)
                    .listen(listener);
                    let server = match built {
                        Ok(s) => s.run(),
                        Err(e) => {
                            let _ = handle_tx.send(None);
                            return Err(e);
                        }
                    };
                    let _ = handle_tx.send(Some(server.handle()));
                    server.await
                });
                // Nothing more will come from the handlers.
                let _ = bridge_tx.send(bridge::BridgeMsg::Shutdown);
                result
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the HTTP server".into(),
                source,
            })?;
        let Some(handle) = handle_rx.recv().ok().flatten() else {
            // The server could not start: no rank has started either.
            return match thread.join() {
                Ok(Err(e)) => Err(ServeError::Http(e)),
                _ => Err(RuntimeError::Panicked {
                    what: "the HTTP server".into(),
                }
                .into()),
            };
        };
        // SIGTERM or Ctrl-C (or SIGHUP), or SIGUSR1 (what `serve --driver mpi` has
        // mpirun forward to every process): stop accepting, answer what is in flight.
        // The handlers are set before the address is announced, so no signal is missed.
        let (signal_tx, signal_rx) = crossbeam_channel::bounded::<()>(2);
        let on_usr1 = signal_tx.clone();
        ctrlc::set_handler(move || {
            let _ = signal_tx.try_send(());
        })
        .map_err(|e| ServeError::Signals(e.to_string()))?;
        let mut usr1 = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
            .map_err(|e| ServeError::Signals(e.to_string()))?;
        std::thread::Builder::new()
            .name("sigusr1".into())
            .spawn(move || {
                if usr1.forever().next().is_some() {
                    let _ = on_usr1.try_send(());
                }
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the signal thread".into(),
                source,
            })?;
        let on_signal = handle.clone();
        let (draining, drain_timeout) = (drain.clone(), opts.drain_timeout);
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if signal_rx.recv().is_ok() {
                    tracing::info!("stopping: no new connections; draining in-flight requests");
                    let until = Instant::now() + drain_timeout;
                    draining.begin(until);
                    let _ = to_bridge.send(bridge::BridgeMsg::Drain(until));
                    actix_web::rt::System::new().block_on(on_signal.stop(true));
                }
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the signal thread".into(),
                source,
            })?;
        announce(addr);
        Ok(HttpSide {
            running: Running {
                handle,
                thread,
                drain,
            },
            bridge_rx,
            metrics,
        })
    }

    /// The bridge, to run in the client's place (it returns once every server stopped),
    /// and the handle that [`HttpSide::finish`] needs.
    fn split(
        self,
        to_front: crossbeam_channel::Sender<ClientItem>,
        from_front: crossbeam_channel::Receiver<Vec<lockstep_actors::vocab::Response>>,
        stream_buffer: usize,
    ) -> (impl FnOnce() -> u64 + Send + 'static, Running) {
        let HttpSide {
            running,
            bridge_rx,
            metrics,
        } = self;
        (
            move || bridge::run(bridge_rx, to_front, from_front, &metrics, stream_buffer),
            running,
        )
    }

    /// The fleet stopped: stops taking requests too (if a signal has not already) and
    /// waits for the HTTP thread. Returns the answers cut at the drain timeout.
    fn finish(
        Running {
            handle,
            thread,
            drain,
        }: Running,
    ) -> Result<u64, ServeError> {
        actix_web::rt::System::new().block_on(handle.stop(true));
        let http = thread.join().map_err(|_| RuntimeError::Panicked {
            what: "the HTTP server".into(),
        })?;
        http.map_err(ServeError::Http)?;
        Ok(drain.cut())
    }
}

/// Serves `scenario`'s fleet on `listener` until SIGTERM or Ctrl-C (or until every
/// server stopped); `announce` is called with the bound address once requests can come.
pub fn serve(
    scenario: &Scenario,
    real: &RealOptions,
    opts: &ServeOptions,
    listener: TcpListener,
    announce: impl FnOnce(SocketAddr),
) -> Result<ServeSummary, ServeError> {
    let fleet = plan(scenario, real)?;
    let text = model_text_of(real)?;
    let clock = WallClock::start();
    let (client_tx, client_rx) = unbounded();
    let (to_client, from_front) = unbounded();
    let board = StatusBoard::default();
    let http = HttpSide::start(&fleet, opts, listener, board.clone(), text, announce)?;
    let (bridge, http) = http.split(client_tx, from_front, opts.stream_buffer);
    let outcome = run_hosts(
        real,
        &fleet,
        clock,
        ClientPorts {
            from_client: client_rx,
            to_client,
            status: Some(board),
        },
        bridge,
    );
    // The fleet stopped on its own (every server failed): stop taking requests too.
    let stopped = HttpSide::finish(http);
    let (end, requests) = outcome?;
    let cut = stopped?;
    Ok(ServeSummary {
        requests,
        cut,
        ranks: end.summaries,
    })
}

/// How the front process of a `serve --driver mpi` run ended.
#[cfg(feature = "mpi")]
pub struct MpiServeSummary {
    /// Requests taken, and every rank's summary.
    pub summary: ServeSummary,
    /// Why the fleet was lost, if it was: this process must then exit at once,
    /// non-zero, without finalising MPI.
    pub lost: Option<String>,
}

/// One process of `lockstep serve --driver mpi`: a server rank, or the front process
/// (world rank 0), which binds the address and serves HTTP in the client's place —
/// the same front host, bridge and handlers as the threads driver. The front process
/// returns its summary; the others `None`.
#[cfg(feature = "mpi")]
pub fn serve_process(
    scenario: &Scenario,
    scenario_text_digest: u64,
    mpi: &lockstep_runtime::mpi::MpiOptions,
    opts: &ServeOptions,
    announce: impl FnOnce(SocketAddr),
) -> Result<Option<MpiServeSummary>, ServeError> {
    let fleet = plan(scenario, &mpi.common)?;
    let text = model_text_of(&mpi.common)?;
    let board = StatusBoard::default();
    let mut http = None;
    let side = lockstep_runtime::mpi::run_process_with(
        &fleet,
        scenario_text_digest,
        mpi,
        Some(board.clone()),
        |ends| {
            let started = bind(opts)
                .and_then(|listener| HttpSide::start(&fleet, opts, listener, board, text, announce))
                .map_err(|e| RuntimeError::ClientStart(e.to_string()))?;
            let (bridge, handle) =
                started.split(ends.to_front, ends.from_front, opts.stream_buffer);
            http = Some(handle);
            Ok(bridge)
        },
    )?;
    let Some(side) = side else {
        return Ok(None);
    };
    let cut = match http {
        Some(h) => HttpSide::finish(h)?,
        None => 0,
    };
    Ok(Some(MpiServeSummary {
        summary: ServeSummary {
            requests: side.client,
            cut,
            ranks: side.end.summaries,
        },
        lost: side.end.lost,
    }))
}
