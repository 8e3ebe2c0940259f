//! `lockstep serve` under test: the binary (threads, or `--driver mpi` from the MPI
//! build) on a free loopback port, spoken to over HTTP; its answers, SSE bodies and
//! Prometheus text read back. Every child process has a deadline and is killed when its
//! test ends.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use lockstep_openai::WORDS;

/// Longest a child may take to start, or to stop after SIGTERM (hang protection, not a
/// speed check).
pub const DEADLINE: Duration = Duration::from_secs(120);

pub fn example(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join("examples")
        .join(name);
    p.to_string_lossy().into_owned()
}

/// A running `lockstep serve`, killed on drop.
pub struct Server {
    child: Child,
    /// `http://ADDR`.
    pub base: String,
    /// The rest of its stdout, line by line.
    lines: mpsc::Receiver<String>,
}

impl Server {
    /// `lockstep serve EXAMPLE --port 0 EXTRA...` (the threads driver).
    pub fn start(scenario: &str, extra: &[&str]) -> Server {
        Server::start_with(Path::new(env!("CARGO_BIN_EXE_lockstep")), scenario, extra)
    }

    /// `BIN serve EXAMPLE --port 0 EXTRA...`.
    pub fn start_with(bin: &Path, scenario: &str, extra: &[&str]) -> Server {
        Server::start_in_env(bin, scenario, extra, &[])
    }

    /// `lockstep serve EXAMPLE --port 0 EXTRA...` with the environment variables `env`.
    pub fn start_env(scenario: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_in_env(
            Path::new(env!("CARGO_BIN_EXE_lockstep")),
            scenario,
            extra,
            env,
        )
    }

    /// `BIN serve EXAMPLE --port 0 EXTRA...` with `env` set, and no API key from the
    /// test's own environment.
    fn start_in_env(bin: &Path, scenario: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(bin)
            .args(["serve", &example(scenario), "--port", "0"])
            .args(extra)
            .env_remove(lockstep_serve::api_key::API_KEY_ENV)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting lockstep serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            base: String::new(),
            lines,
        };
        let line = server
            .lines
            .recv_timeout(DEADLINE)
            .expect("lockstep serve announced no address");
        let addr = line
            .split("http://")
            .nth(1)
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        server.base = format!("http://{addr}");
        server
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `signal` (`TERM`, `INT`).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success());
    }

    /// Waits (up to the deadline) for the exit; its status and the rest of stdout.
    pub fn wait_exit(&mut self) -> (std::process::ExitStatus, Vec<String>) {
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting") {
                let rest: Vec<String> = self.lines.try_iter().collect();
                return (status, rest);
            }
            assert!(Instant::now() < end, "lockstep serve did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(DEADLINE).build()
}

/// Status and JSON body, whatever the status.
pub fn post(url: &str, body: &str, key: Option<&str>) -> (u16, String) {
    let mut req = agent().post(url).set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.send_string(body) {
        Ok(r) => (r.status(), r.into_string().expect("a body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("a body")),
        Err(e) => panic!("POST {url}: {e}"),
    }
}

pub fn get(url: &str) -> (u16, String) {
    match agent().get(url).call() {
        Ok(r) => (r.status(), r.into_string().expect("a body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("a body")),
        Err(e) => panic!("GET {url}: {e}"),
    }
}

pub fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

pub fn assert_words(text: &str, n: usize) {
    let words: Vec<&str> = text.split(' ').collect();
    assert_eq!(words.len(), n, "{text:?}");
    assert!(words.iter().all(|w| WORDS.contains(w)), "{text:?}");
}

/// The events of an SSE body: each `data: ...` payload, checking the framing.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "an SSE body ends with a blank line");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                .to_string()
        })
        .collect()
}

/// Prometheus text: every sample line is `name[{labels}] value`; returns the samples.
pub fn prometheus_samples(text: &str) -> Vec<(String, f64)> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("not a sample: {line:?}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("not a number in {line:?}"));
        let metric = name.split('{').next().unwrap_or(name);
        assert!(
            metric
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        samples.push((name.to_string(), v));
    }
    samples
}

pub fn sample(samples: &[(String, f64)], name: &str) -> f64 {
    samples
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in {samples:?}"))
        .1
}

/// The latest `/metrics` samples.
pub fn scrape(s: &Server) -> Vec<(String, f64)> {
    let (code, text) = get(&s.url("/metrics"));
    assert_eq!(code, 200);
    prometheus_samples(&text)
}

/// Σ of every rank's sample of `metric` (its labelled series).
pub fn over_ranks(samples: &[(String, f64)], metric: &str) -> f64 {
    let prefix = format!("{metric}{{");
    samples
        .iter()
        .filter(|(n, _)| n.starts_with(&prefix))
        .map(|(_, v)| v)
        .sum()
}

/// Polls `/metrics` until `done` holds (or the deadline passes: the last samples).
pub fn scrape_until(s: &Server, done: impl Fn(&[(String, f64)]) -> bool) -> Vec<(String, f64)> {
    // Ranks publish every quarter second and on going idle: 30 s is hang protection.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let samples = scrape(s);
        if done(&samples) || Instant::now() > end {
            return samples;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Opens a raw connection, sends one completion request and reads the first bytes of
/// the answer (a stream's first event, or nothing for a whole answer), then returns the
/// connection, so the caller decides when the client leaves.
pub fn start_request(s: &Server, body: &Value, read_first: bool) -> std::net::TcpStream {
    use std::io::Write as _;
    let addr = s.base.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr).expect("connecting");
    let body = body.to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("sending");
    if read_first {
        c.set_read_timeout(Some(DEADLINE)).expect("a timeout");
        let mut first = [0u8; 256];
        let n = c.read(&mut first).expect("the answer starts");
        let head = String::from_utf8_lossy(&first[..n]);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }
    c
}
