//! What the command line tells its user (issue 32): each test is one thing that used to
//! mislead or to come late, said now in so many words.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn example(name: &str) -> String {
    repo()
        .join("examples")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn temp(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-cli-output-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn lockstep(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run lockstep")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Every line of `text` that says error says it as `error: ` at its start, once.
fn one_error_line(text: &str) {
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.to_lowercase().contains("error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {text}");
    assert!(errors[0].starts_with("error: "), "{text}");
}

/// A bad command line exits 64 (sysexits' EX_USAGE), not 2 as a crashed run does; help
/// and version succeed; `--help` documents the statuses.
#[test]
fn usage_errors_exit_64_and_help_exits_0() {
    let o = lockstep(&["sim", "--no-such-option", &example("agg-balanced.toml")]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
    let o = lockstep(&["sim"]);
    assert_eq!(
        o.status.code(),
        Some(64),
        "a missing argument: {}",
        stderr(&o)
    );
    let o = lockstep(&["no-such-command"]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    let o = lockstep(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(
        stdout(&o).contains("64"),
        "the exit statuses are documented"
    );
    assert!(
        stdout(&o).contains("78"),
        "the exit statuses are documented"
    );
    assert_eq!(lockstep(&["sim", "--help"]).status.code(), Some(0));
    assert_eq!(lockstep(&["--version"]).status.code(), Some(0));
}

/// A refused configuration exits 78 (EX_CONFIG), not 1 as a failed run does, in one
/// `error: ` line; a seat skew the fixed policy refuses says how to run it anyway.
#[test]
fn configuration_errors_exit_78_with_one_error_line() {
    let bad = temp("bad.toml");
    std::fs::write(&bad, "name = \"bad\"\n[[server]\n").unwrap();
    let o = lockstep(&["sim", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(78), "a bad TOML: {}", stderr(&o));
    one_error_line(&stderr(&o));
    std::fs::remove_file(&bad).ok();

    let o = lockstep(&[
        "sim",
        &example("agg-balanced.toml"),
        "--set",
        "no.such.key=1",
    ]);
    assert_eq!(o.status.code(), Some(78), "a bad --set: {}", stderr(&o));
    one_error_line(&stderr(&o));

    // Refused under the default policy, with the hint that runs it anyway.
    let o = lockstep(&["sim", &example("legacy-skew.toml")]);
    assert_eq!(o.status.code(), Some(78), "{}", stderr(&o));
    one_error_line(&stderr(&o));
    assert!(stderr(&o).contains("seats.rederive=true"), "{}", stderr(&o));
    let o = lockstep(&["run", &example("legacy-skew.toml")]);
    assert_eq!(o.status.code(), Some(78), "{}", stderr(&o));
}

/// A workload whose prompt + output exceed the model's positions is refused before the
/// run starts, naming both numbers (as `serve` refuses such a request), by `sim` and
/// `run` alike, with the configuration's exit status.
#[test]
fn a_model_too_short_for_the_workload_is_refused_at_startup() {
    let dir = temp("tiny-model");
    let o = lockstep(&["model", "init", dir.to_str().unwrap(), "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let max = config["max_position_embeddings"].as_u64().unwrap();
    let scenario = temp("long.toml");
    std::fs::write(
        &scenario,
        format!(
            "name = \"long\"\n\n[[server]]\nname = \"agg0\"\nmax_batch_size = 4\n\n\
             [server.kv_cache_config]\ntokens_per_block = 32\nmax_tokens = 65536\n\n\
             [workload]\nkind = \"closed_loop\"\nconcurrency = 2\nnum_requests = 4\n\
             input_len = [16, {}]\noutput_len = 200\n",
            max - 100
        ),
    )
    .unwrap();
    for cmd in ["sim", "run"] {
        let started = Instant::now();
        let o = lockstep(&[
            cmd,
            scenario.to_str().unwrap(),
            "--model",
            dir.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(78), "{cmd}: {err}");
        one_error_line(&err);
        assert!(err.contains(&format!("{}", max + 100)), "{cmd}: {err}");
        assert!(err.contains(&format!("{max}")), "{cmd}: {err}");
        assert!(err.contains("max_position_embeddings"), "{cmd}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{cmd} refused only after {:?}",
            started.elapsed()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&scenario).ok();
}

/// An open-loop fleet that completes clearly fewer requests per second than offered says
/// so under the report (examples/agg-balanced.toml offers 20 req/s).
#[test]
fn a_saturated_open_loop_fleet_is_said_so() {
    let o = lockstep(&[
        "sim",
        &example("agg-balanced.toml"),
        "--set",
        "workload.num_requests=300",
    ]);
    let out = stdout(&o);
    assert!(
        out.contains("offered 20.0 req/s, achieved") && out.contains("the fleet is saturated"),
        "{out}"
    );
    // A fleet that keeps up says nothing of it.
    let o = lockstep(&[
        "sim",
        &example("agg-balanced.toml"),
        "--set",
        "workload.num_requests=100",
        "--set",
        "workload.rate=1.0",
    ]);
    assert!(!stdout(&o).contains("saturated"), "{}", stdout(&o));
}

/// `ab` prints no raw log lines; the legacy side's seat skew is in the report's words.
#[test]
fn ab_prints_no_log_lines() {
    let o = lockstep(&[
        "ab",
        &example("legacy-skew.toml"),
        "--base",
        "legacy",
        "--treatment",
        "legacy",
        "--set",
        "workload.num_requests=40",
    ]);
    let err = stderr(&o);
    assert!(!err.contains("WARN"), "{err}");
    assert!(!err.contains("lockstep_"), "{err}");
    assert!(stdout(&o).contains("note (legacy"), "{}", stdout(&o));
}

/// `serve` at zero modeled cost says so at startup, with what a client's throughput then
/// means.
#[test]
fn serve_at_zero_cost_says_so() {
    let mut child = Command::new(BIN)
        .args([
            "serve",
            &example("agg-balanced.toml"),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(30));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("a line on stderr at startup");
    assert!(line.contains("zero modeled cost"), "{line}");
    assert!(line.contains("--time-scale"), "{line}");
}

/// A reader that goes away (`lockstep … | head`) ends the output, not the command: no
/// panic, and the command's own exit status. The pipe's read end is closed before the
/// command starts, so every write it makes fails.
#[test]
fn a_closed_stdout_is_no_panic_and_keeps_the_exit_status() {
    let run = |args: &[&str]| {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let output = Command::new(BIN)
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("run lockstep");
        (output.status.code(), stderr(&output))
    };
    let (code, err) = run(&["profiles"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.is_empty(), "a broken pipe is silent: {err}");
    // A run that ends in a configuration error still says so, and exits 78.
    let (code, err) = run(&["sim", &example("ctx-only.toml"), "--set", "seed=oops"]);
    assert_eq!(code, Some(78), "{err}");
    assert!(err.contains("error: "), "{err}");
    let (code, err) = run(&["sim", &example("ctx-only.toml")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
