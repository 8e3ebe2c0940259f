//! What the command line tells its user (issue 32): each test is one thing that used to
//! mislead or to come late, said now in so many words.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    let d = std::env::temp_dir().join(format!("lockstep-cli-output-{}", std::process::id()));
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
