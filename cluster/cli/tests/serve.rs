//! `lockstep serve` end to end: the binary on a free loopback port, spoken to over HTTP.
//! Every child process has a deadline and is killed when its test ends.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::serve::*;

#[test]
fn a_completion_is_answered_whole_with_its_usage() {
    let s = Server::start("agg-balanced.toml", &[]);
    assert_eq!(get(&s.url("/health")).0, 200);
    let (code, body) = get(&s.url("/v1/models"));
    assert_eq!(code, 200);
    assert_eq!(json_of(&body)["data"][0]["id"], "agg-balanced");
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"model": "agg-balanced", "prompt": "the quick brown fox", "max_tokens": 7, "temperature": 0.7, "seed": 3, "stop": ["x"]}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
    let v = json_of(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_words(v["choices"][0]["text"].as_str().expect("text"), 7);
    // A prompt of token ids counts one token per id.
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(json_of(&body)["usage"]["prompt_tokens"], 6);
}

#[test]
fn a_streamed_chat_completion_on_a_disaggregated_fleet_is_framed_as_sse() {
    let s = Server::start("disagg-small.toml", &[]);
    let max = 6;
    let (code, body) = post(
        &s.url("/v1/chat/completions"),
        &json!({
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say something now"}],
            "max_tokens": max,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
        None,
    );
    assert_eq!(code, 200, "{body}");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    let usage = chunks.last().expect("a usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": max, "total_tokens": 5 + max})
    );
    let mut text = String::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert_words(&text, max);
}

#[test]
fn metrics_are_prometheus_text_and_their_counters_move() {
    let s = Server::start("agg-balanced.toml", &[]);
    let (code, before) = get(&s.url("/metrics"));
    assert_eq!(code, 200);
    let before = prometheus_samples(&before);
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a b c", "max_tokens": 9}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
    let (_, after) = get(&s.url("/metrics"));
    assert!(after.trim_end().ends_with("# EOF"), "{after}");
    let after = prometheus_samples(&after);
    let delta = |name: &str| sample(&after, name) - sample(&before, name);
    assert_eq!(delta("lockstep_prompt_tokens_total"), 3.0);
    assert_eq!(delta("lockstep_generation_tokens_total"), 9.0);
    assert_eq!(delta("lockstep_request_success_total"), 1.0);
    assert_eq!(delta("lockstep_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(delta("lockstep_e2e_request_latency_seconds_count"), 1.0);
    // The front door's accounting: one request served, for some time, and time spent
    // on its nine tokens (whole answers too).
    assert_eq!(delta("lockstep_front_service_seconds_count"), 1.0);
    assert!(delta("lockstep_front_service_seconds_sum") > 0.0);
    assert!(delta("lockstep_front_output_seconds_total") > 0.0);
    assert_eq!(sample(&after, "lockstep_num_requests_running"), 0.0);
    assert_eq!(sample(&after, "lockstep_num_requests_waiting"), 0.0);
}

#[test]
fn the_api_key_is_required_when_set() {
    let s = Server::start("agg-balanced.toml", &["--api-key", "sekrit"]);
    let body = r#"{"prompt": "hi", "max_tokens": 1}"#;
    let (code, answer) = post(&s.url("/v1/completions"), body, None);
    assert_eq!(code, 401, "{answer}");
    assert_eq!(json_of(&answer)["error"]["code"], "invalid_api_key");
    assert_eq!(post(&s.url("/v1/completions"), body, Some("wrong")).0, 401);
    let (code, answer) = post(&s.url("/v1/completions"), body, Some("sekrit"));
    assert_eq!(code, 200, "{answer}");
    assert_eq!(get(&s.url("/health")).0, 200);
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let s = Server::start(
        "agg-balanced.toml",
        &["--max-body-bytes", "1000", "--max-prompt-tokens", "4"],
    );
    let big = json!({"prompt": "x".repeat(2000)}).to_string();
    let (code, answer) = post(&s.url("/v1/completions"), &big, None);
    assert_eq!(code, 413, "{answer}");
    assert!(json_of(&answer)["error"]["message"].is_string());
    let (code, answer) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "max_tokens": -1}"#,
        None,
    );
    assert_eq!(code, 400, "{answer}");
    let e = &json_of(&answer)["error"];
    assert_eq!(e["param"], "max_tokens");
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e["message"].as_str().unwrap_or("").contains("-1"), "{e}");
    let (code, answer) = post(
        &s.url("/v1/chat/completions"),
        r#"{"messages": [{"role": "user", "content": "one two three four five"}]}"#,
        None,
    );
    assert_eq!(code, 400, "{answer}");
    assert_eq!(json_of(&answer)["error"]["param"], "messages");
    // No model, no vocabulary to check stop ids against: refused naming the field.
    let (code, answer) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "stop_token_ids": [1]}"#,
        None,
    );
    assert_eq!(code, 400, "{answer}");
    assert_eq!(json_of(&answer)["error"]["param"], "stop_token_ids");
}

/// `lockstep serve ARGS...` with `env`, expected to exit non-zero before it serves:
/// its stderr.
fn startup_failure(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .arg("serve")
        .args(args)
        .env_remove(lockstep_serve::api_key::API_KEY_ENV)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting lockstep serve");
    let end = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(st) = child.try_wait().expect("waiting") {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("lockstep serve {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut err)
        .expect("stderr");
    assert!(!status.success(), "{args:?} started: {err}");
    err
}

#[test]
fn a_non_loopback_host_without_a_key_is_refused() {
    let scenario = example("agg-balanced.toml");
    let err = startup_failure(&[&scenario, "--host", "0.0.0.0", "--port", "0"], &[]);
    assert!(
        err.contains("--api-key") && err.contains("0.0.0.0"),
        "{err}"
    );
}

/// An empty key would turn authentication off (and pass the non-loopback rule): it is
/// refused at startup, on any address, naming where it came from.
#[test]
fn an_empty_api_key_is_refused_at_startup_naming_its_source() {
    let scenario = example("agg-balanced.toml");
    let err = startup_failure(
        &[
            &scenario,
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--api-key",
            "",
        ],
        &[],
    );
    assert!(err.contains("--api-key: the API key is empty"), "{err}");
    let err = startup_failure(&[&scenario, "--port", "0"], &[("LOCKSTEP_API_KEY", "  ")]);
    assert!(
        err.contains("LOCKSTEP_API_KEY: the API key is empty"),
        "{err}"
    );
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-empty-key-{}", std::process::id()));
    std::fs::write(&file, "\n").expect("a key file");
    let file_arg = file.to_string_lossy().into_owned();
    let err = startup_failure(
        &[&scenario, "--port", "0", "--api-key-file", &file_arg],
        &[],
    );
    assert!(
        err.contains(&format!("--api-key-file {file_arg}: the API key is empty")),
        "{err}"
    );
    let _ = std::fs::remove_file(&file);
}

/// A key from `--api-key-file` (its trailing newline dropped) or from `LOCKSTEP_API_KEY`
/// is enforced as `--api-key`'s is.
#[test]
fn a_key_from_a_file_or_the_environment_is_enforced() {
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-key-file-{}", std::process::id()));
    std::fs::write(&file, "from-the-file\n").expect("a key file");
    let file_arg = file.to_string_lossy().into_owned();
    let body = r#"{"prompt": "hi", "max_tokens": 1}"#;
    for (s, key) in [
        (
            Server::start("agg-balanced.toml", &["--api-key-file", &file_arg]),
            "from-the-file",
        ),
        (
            Server::start_env(
                "agg-balanced.toml",
                &[],
                &[("LOCKSTEP_API_KEY", "from-the-env")],
            ),
            "from-the-env",
        ),
    ] {
        let (code, answer) = post(&s.url("/v1/completions"), body, None);
        assert_eq!(code, 401, "{key}: {answer}");
        assert_eq!(json_of(&answer)["error"]["code"], "invalid_api_key");
        assert_eq!(post(&s.url("/v1/completions"), body, Some("wrong")).0, 401);
        let (code, answer) = post(&s.url("/v1/completions"), body, Some(key));
        assert_eq!(code, 200, "{key}: {answer}");
    }
    let _ = std::fs::remove_file(&file);
}

#[test]
fn two_key_sources_at_once_are_refused_naming_both() {
    let scenario = example("agg-balanced.toml");
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-two-keys-{}", std::process::id()));
    std::fs::write(&file, "k2\n").expect("a key file");
    let file_arg = file.to_string_lossy().into_owned();
    let env = [("LOCKSTEP_API_KEY", "k3")];
    let by_env = "the environment variable LOCKSTEP_API_KEY";
    // (flags, environment, what the error names)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], String);
    let cases: [Case<'_>; 3] = [
        (
            &["--api-key", "k1", "--api-key-file", &file_arg],
            &[],
            format!("by --api-key and by --api-key-file {file_arg}:"),
        ),
        (
            &["--api-key", "k1"],
            &env,
            format!("by --api-key and by {by_env}:"),
        ),
        (
            &["--api-key-file", &file_arg],
            &env,
            format!("by --api-key-file {file_arg} and by {by_env}:"),
        ),
    ];
    for (flags, env, named) in cases {
        let mut args = vec![scenario.as_str(), "--port", "0"];
        args.extend_from_slice(flags);
        let err = startup_failure(&args, env);
        assert!(
            err.contains(&format!("the API key is given twice, {named}")),
            "{flags:?} {env:?}: {err}"
        );
    }
    let _ = std::fs::remove_file(&file);
}

#[test]
fn sigterm_answers_the_request_in_flight_then_exits() {
    // Paced by the model, so the request is still streaming when SIGTERM comes.
    let mut s = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    let max = 400;
    let resp = agent()
        .post(&s.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&json!({"prompt": "go", "max_tokens": max, "stream": true, "stream_options": {"include_usage": true}}).to_string())
        .expect("the stream starts");
    let mut reader = BufReader::new(resp.into_reader());
    let mut first = String::new();
    reader.read_line(&mut first).expect("a first event");
    assert!(first.starts_with("data: {"), "{first:?}");
    s.signal("TERM");
    // It stops accepting connections while the stream goes on.
    let end = Instant::now() + DEADLINE;
    while agent().get(&s.url("/health")).call().is_ok() {
        assert!(Instant::now() < end, "still accepting after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut rest = String::new();
    reader
        .read_to_string(&mut rest)
        .expect("the rest of the stream");
    let body = format!("{first}{rest}");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage = json_of(&events[events.len() - 2]);
    assert_eq!(usage["usage"]["completion_tokens"], max);
    println!(
        "{} token events, {} of them read after the server stopped accepting",
        events.len() - 3,
        sse_events(&rest[1..]).len().saturating_sub(3)
    );
    let (status, out) = s.wait_exit();
    assert!(status.success(), "{status:?}: {out:?}");
    assert!(
        out.iter().any(|l| l.contains("stopped after 1 requests")),
        "{out:?}"
    );
}

#[test]
fn ctrl_c_stops_an_idle_server() {
    let mut s = Server::start("disagg-small.toml", &[]);
    assert_eq!(get(&s.url("/health")).0, 200);
    s.signal("INT");
    let (status, out) = s.wait_exit();
    assert!(status.success(), "{status:?}: {out:?}");
    assert!(
        out.iter().any(|l| l.contains("stopped after 0 requests")),
        "{out:?}"
    );
}

/// Run by `scripts/test.sh` after it installs the package (`--ignored`); without the
/// package it prints SKIPPED and checks nothing.
#[test]
#[ignore = "needs the openai Python package: scripts/test.sh installs it and runs this"]
fn the_official_openai_client_talks_to_it() {
    let has = Command::new("python3")
        .args(["-c", "import openai"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        println!("SKIPPED: the official `openai` Python package is not installed");
        return;
    }
    let s = Server::start("agg-balanced.toml", &["--api-key", "k"]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="k")
r = c.completions.create(model="agg-balanced", prompt="one two three", max_tokens=5)
assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 3, r
n = 0
for ch in c.chat.completions.create(model="agg-balanced", messages=[{"role": "user", "content": "hi there"}], max_tokens=4, stream=True, stream_options={"include_usage": True}):
    if ch.usage is not None:
        assert ch.usage.completion_tokens == 4, ch
        n += 1
assert n == 1
try:
    openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="bad").models.list()
    raise SystemExit("no 401")
except openai.AuthenticationError:
    pass
# No forward without --model: logprobs are a 400 naming the field.
try:
    c.completions.create(model="agg-balanced", prompt="one", max_tokens=2, logprobs=1)
    raise SystemExit("no 400")
except openai.BadRequestError as e:
    assert e.body["param"] == "logprobs", e.body
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script, &s.base])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    drop(s);
    // With a model, the client reads the logprobs objects (the numbers are checked
    // against the dense forward in `a_models_logprobs_are_the_dense_forwards_log_softmax`).
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-openai-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &lockstep_gpu::model::InitOptions::default())
        .expect("init");
    let s = Server::start("model/agg-tiny.toml", &["--model", &dir.to_string_lossy()]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
m = c.models.list().data[0].id
r = c.completions.create(model=m, prompt="one two", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
lp = r.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4, lp
assert all(x <= 0 for x in lp.token_logprobs), lp
assert all(2 <= len(d) <= 3 for d in lp.top_logprobs), lp
assert lp.text_offset[0] == 0, lp
r = c.completions.create(model=m, prompt="one two", max_tokens=2, logprobs=1, echo=True, extra_body={"ignore_eos": True})
lp = r.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) >= 4, lp
assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
assert r.choices[0].text.startswith("one two"), r.choices[0].text
r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
content = r.choices[0].logprobs.content
assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content), content
assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob, content
n = 0
for ch in c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, stream=True, extra_body={"ignore_eos": True}):
    if ch.choices and ch.choices[0].logprobs is not None:
        n += len(ch.choices[0].logprobs.content)
assert n == 3, n
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script, &s.base])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_client_that_disconnects_cancels_its_request_and_its_kv_is_freed() {
    // Paced by the model: 2,000 tokens take far longer than the test.
    let s = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    let long = |stream: bool| json!({"prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z", "max_tokens": 2000, "stream": stream});
    for (stream, n) in [(true, 1.0), (false, 2.0)] {
        let c = start_request(&s, &long(stream), stream);
        // While it runs its rank holds KV for it (the control: the check below binds).
        let running = scrape_until(&s, |m| {
            over_ranks(m, "lockstep_kv_cache_used_blocks") > 0.0
                && sample(m, "lockstep_num_requests_running") == 1.0
        });
        assert!(
            over_ranks(&running, "lockstep_kv_cache_used_blocks") > 0.0,
            "stream {stream}: no KV held while the request runs: {running:?}"
        );
        drop(c);
        let after = scrape_until(&s, |m| {
            sample(m, "lockstep_request_cancelled_total") == n
                && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
                && over_ranks(m, "lockstep_rank_requests_resident") == 0.0
        });
        assert_eq!(
            sample(&after, "lockstep_request_cancelled_total"),
            n,
            "stream {stream}: {after:?}"
        );
        assert_eq!(
            over_ranks(&after, "lockstep_kv_cache_used_blocks"),
            0.0,
            "stream {stream}: KV still held after the client left"
        );
        assert_eq!(over_ranks(&after, "lockstep_rank_requests_resident"), 0.0);
        assert_eq!(sample(&after, "lockstep_num_requests_running"), 0.0);
        assert_eq!(sample(&after, "lockstep_request_success_total"), 0.0);
    }
    // The server goes on serving.
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
}

#[test]
fn a_full_queue_answers_429_with_retry_after_at_once() {
    let s = Server::start(
        "agg-balanced.toml",
        &["--time-scale", "1", "--max-pending", "1"],
    );
    let c = start_request(
        &s,
        &json!({"prompt": "a b", "max_tokens": 2000, "stream": true}),
        true,
    );
    let refused = agent()
        .post(&s.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(r#"{"prompt": "a", "max_tokens": 2}"#);
    let Err(ureq::Error::Status(429, r)) = refused else {
        panic!("expected 429, got {refused:?}");
    };
    assert_eq!(r.header("Retry-After"), Some("1"));
    let e = json_of(&r.into_string().expect("a body"));
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-pending")),
        "{e}"
    );
    assert_eq!(sample(&scrape(&s), "lockstep_request_rejected_total"), 1.0);
    // Once the first leaves, its place is free again.
    drop(c);
    scrape_until(&s, |m| sample(m, "lockstep_request_cancelled_total") == 1.0);
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
}

#[test]
fn a_request_no_server_could_run_is_refused_naming_the_limit() {
    let s = Server::start("agg-balanced.toml", &[]);
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a b c", "max_tokens": 1000000}"#,
        None,
    );
    assert_eq!(code, 400, "{body}");
    let e = json_of(&body);
    assert_eq!(e["error"]["param"], "max_tokens");
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("KV blocks")),
        "{e}"
    );
    // Nothing reached the fleet.
    assert_eq!(sample(&scrape(&s), "lockstep_request_failure_total"), 0.0);
}

/// Issue 29 item 7: in a fleet whose servers differ, a request some server can run is
/// answered (the front routes it there; it used to be a 500 every other request), and
/// only a request no server can run is refused, 400 naming the limit.
#[test]
fn a_heterogeneous_fleet_answers_every_request_some_server_can_run() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("heterogeneous.toml");
    let server = |name: &str, t: u32| {
        format!(
            "[[server]]\nname = \"{name}\"\nmax_batch_size = 4\nmax_num_tokens = {t}\n\
             enable_chunked_prefill = false\n[server.kv_cache_config]\ntokens_per_block = 16\n\
             max_tokens = 65536\n"
        )
    };
    std::fs::write(
        &path,
        format!(
            "name = \"heterogeneous\"\n[front]\npolicy = \"round_robin\"\n{}{}\
             [workload]\nkind = \"closed_loop\"\nconcurrency = 1\nnum_requests = 1\n\
             input_len = 8\noutput_len = 4\n",
            server("short", 64),
            server("long", 1024),
        ),
    )
    .unwrap();
    let s = Server::start(path.to_str().unwrap(), &[]);
    let prompt = |n: u32| -> String {
        let ids: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
        format!(r#"{{"prompt": [{}], "max_tokens": 3}}"#, ids.join(", "))
    };
    for _ in 0..4 {
        let (code, body) = post(&s.url("/v1/completions"), &prompt(200), None);
        assert_eq!(code, 200, "{body}");
        assert_eq!(json_of(&body)["usage"]["completion_tokens"], 3);
    }
    let (code, body) = post(&s.url("/v1/completions"), &prompt(2000), None);
    assert_eq!(code, 400, "{body}");
    let message = json_of(&body)["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("max_num_tokens 1024"), "{message}");
    assert_eq!(sample(&scrape(&s), "lockstep_request_failure_total"), 0.0);
}

#[test]
fn metrics_show_every_rank_and_prefix_cache_hits_from_shared_prompts() {
    let s = Server::start("agg-kv-aware.toml", &[]);
    let prompt: Vec<u32> = (1..=256).collect();
    for _ in 0..3 {
        let (code, body) = post(
            &s.url("/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": 2}).to_string(),
            None,
        );
        assert_eq!(code, 200, "{body}");
    }
    // A rank publishes its counters every quarter second and on going idle: wait for
    // the publication that follows the third request.
    let m = scrape_until(&s, |m| {
        over_ranks(m, "lockstep_prefix_cache_hit_blocks_total") > 0.0
            && over_ranks(m, "lockstep_rank_routed_requests_total") == 3.0
    });
    assert!(
        over_ranks(&m, "lockstep_prefix_cache_hit_blocks_total") > 0.0,
        "the same prompt three times reuses its blocks: {m:?}"
    );
    assert_eq!(over_ranks(&m, "lockstep_rank_routed_requests_total"), 3.0);
    let ranks = m
        .iter()
        .filter(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
        .count();
    assert!(ranks >= 2, "one series per rank: {m:?}");
}

#[test]
fn a_stop_string_ends_the_answer_and_the_rest_of_the_request_is_cancelled() {
    // Paced by the model: without the stop, 2,000 tokens would take far longer than the
    // test's deadline. A space ends the answer after its first word.
    let s = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    let started = Instant::now();
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a b c d", "max_tokens": 2000, "stop": " "}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{body}");
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert_words(text, 1);
    // The token that brought the stop string was generated too.
    assert_eq!(v["usage"]["completion_tokens"], 2, "{body}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Streamed: the chunks' text is one word, the last chunk finishes with "stop".
    let (code, body) = post(
        &s.url("/v1/chat/completions"),
        &json!({
            "messages": [{"role": "user", "content": "a b c d"}],
            "max_tokens": 2000, "stream": true, "stop": [" ", "never"],
        })
        .to_string(),
        None,
    );
    assert_eq!(code, 200, "{body}");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_words(&text, 1);
    assert_eq!(
        chunks.last().expect("a chunk")["choices"][0]["finish_reason"],
        "stop"
    );
    // Both requests end on their ranks, count as successes, and hold no KV.
    let after = scrape_until(&s, |m| {
        sample(m, "lockstep_request_success_total") == 2.0
            && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
    });
    assert_eq!(
        sample(&after, "lockstep_request_success_total"),
        2.0,
        "{after:?}"
    );
    assert_eq!(sample(&after, "lockstep_request_cancelled_total"), 0.0);
    assert_eq!(over_ranks(&after, "lockstep_kv_cache_used_blocks"), 0.0);
    assert_eq!(sample(&after, "lockstep_num_requests_running"), 0.0);
    // A bad stop names the field.
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}"#,
        None,
    );
    assert_eq!(code, 400, "{body}");
    assert_eq!(json_of(&body)["error"]["param"], "stop", "{body}");
    // So does one past the length bound, with its length.
    let long = "x".repeat(lockstep_openai::MAX_STOP_STRING_BYTES + 1);
    let (code, body) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "a", "stop": ["a", long]}).to_string(),
        None,
    );
    assert_eq!(code, 400, "{body}");
    let e = &json_of(&body)["error"];
    assert_eq!(e["param"], "stop", "{body}");
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("stop[1] is 1025 bytes")),
        "{body}"
    );
}

#[test]
fn curl_streams_a_chat_completion() {
    let s = Server::start("agg-balanced.toml", &[]);
    let body = json!({
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5, "stream": true,
    })
    .to_string();
    let out = Command::new("curl")
        .args([
            "-sS",
            "-N",
            "--max-time",
            "60",
            "-H",
            "Content-Type: application/json",
            "-d",
        ])
        .arg(&body)
        .arg(s.url("/v1/chat/completions"))
        .output()
        .expect("curl (scripts/test.sh installs it when missing)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events = sse_events(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let text: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| {
            json_of(e)["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_words(&text, 5);
}

/// `serve --model`: a prompt longer in bytes than `--max-prompt-tokens` tokens of the
/// model's tokenizer can hold is a 400 naming the field and both numbers, refused from
/// its size before it is tokenized; a prompt that fits is answered.
#[test]
fn a_models_prompt_too_long_in_bytes_for_the_token_limit_is_refused() {
    use lockstep_gpu::model::{InitOptions, TextTokenizer};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-bytes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let per_token = TextTokenizer::load(&dir)
        .expect("tokenizer")
        .max_bytes_per_token()
        .expect("a byte-level BPE bounds the bytes of a token");
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start(
        "model/agg-tiny.toml",
        &["--model", &dir_arg, "--max-prompt-tokens", "8"],
    );
    let (most, bytes) = (8 * per_token, 8 * per_token + 1);
    // One word: the word count checked first lets it through.
    let long = "x".repeat(bytes);
    for (route, body, field) in [
        (
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 2}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}], "max_tokens": 2}),
            "messages",
        ),
    ] {
        let (code, answer) = post(&s.url(route), &body.to_string(), None);
        assert_eq!(code, 400, "{answer}");
        let e = &json_of(&answer)["error"];
        assert_eq!(e["param"], field, "{answer}");
        let message = e["message"].as_str().expect("a message");
        assert!(
            message.contains(&format!("{field} is "))
                && message.contains("bytes")
                && message.contains("limit of 8 tokens")
                && message.contains(&format!("at most {most} bytes")),
            "{answer}"
        );
    }
    assert!(
        json_of(
            &post(
                &s.url("/v1/completions"),
                &json!({"prompt": long}).to_string(),
                None
            )
            .1
        )["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("prompt is {bytes} bytes"))),
    );
    let (code, answer) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "hello there", "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{answer}");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A whole (not streamed) chat completion of one user message.
fn chat_answer(s: &Server, message: &str, max_tokens: usize) -> Value {
    let body = json!({
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
    })
    .to_string();
    let (code, answer) = post(&s.url("/v1/chat/completions"), &body, None);
    assert_eq!(code, 200, "{answer}");
    json_of(&answer)
}

/// `serve --model`: chat completions answered with the tiny model's own text, equal to
/// its dense greedy generation from the chat prompt, ending at the model's end of
/// sequence (`stop`) or at `max_tokens` (`length`), both seen here; streamed, the same
/// text; a request past the model's positions refused naming `max_completion_tokens`.
#[test]
fn a_model_answers_chat_completions_with_its_greedy_text() {
    use lockstep_gpu::model::{InitOptions, Model, TextTokenizer, greedy_reference};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let eos: Vec<u32> = model
        .config
        .eos_token_ids
        .iter()
        .copied()
        .chain(tokenizer.token_id("<|im_end|>"))
        .collect();
    const MAX_TOKENS: usize = 48;
    // (prompt ids, expected text, completion tokens, finish reason) of a message.
    let expect = |message: &str| {
        let prompt = tokenizer
            .encode(
                &tokenizer
                    .chat_prompt_messages(&[("user".into(), message.into())])
                    .expect("the chat template"),
            )
            .expect("encode");
        let ids = greedy_reference(&model, &prompt, MAX_TOKENS).expect("reference");
        let (shown, finish) = match ids.iter().position(|t| eos.contains(t)) {
            Some(end) => (&ids[..end], ("stop", end + 1)),
            None => (&ids[..], ("length", MAX_TOKENS)),
        };
        (
            prompt.len(),
            tokenizer.decode(shown).expect("decode"),
            finish,
        )
    };
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start("model/agg-tiny.toml", &["--model", &dir_arg]);
    // Served under the model directory's name, as vLLM serves a path.
    let (_, models) = get(&s.url("/v1/models"));
    let name = dir
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned();
    assert_eq!(json_of(&models)["data"][0]["id"], name.as_str());
    let mut finishes = Vec::new();
    for i in 0..12 {
        let message = format!("Question {i}: what is the paged KV cache?");
        let (prompt_len, expected, (finish, completion)) = expect(&message);
        let v = chat_answer(&s, &message, MAX_TOKENS);
        assert_eq!(
            v["choices"][0]["message"]["content"],
            expected.as_str(),
            "{message}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{message}");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
        assert_eq!(v["usage"]["completion_tokens"], completion);
        finishes.push(finish);
        // Streamed: the deltas add up to the same text, with the same finish.
        let streamed = json!({
            "messages": [{"role": "user", "content": message}],
            "max_tokens": MAX_TOKENS,
            "stream": true,
        })
        .to_string();
        let (code, events) = post(&s.url("/v1/chat/completions"), &streamed, None);
        assert_eq!(code, 200, "{events}");
        let chunks: Vec<Value> = events
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(json_of)
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, expected, "{message}");
        assert!(
            chunks
                .iter()
                .any(|c| c["choices"][0]["finish_reason"] == finish),
            "{events}"
        );
    }
    assert!(
        finishes.contains(&"stop") && finishes.contains(&"length"),
        "both endings are exercised: {finishes:?}"
    );
    let too_long = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 100_000,
    })
    .to_string();
    let (code, err) = post(&s.url("/v1/chat/completions"), &too_long, None);
    assert_eq!(code, 400, "{err}");
    assert_eq!(json_of(&err)["error"]["param"], "max_completion_tokens");
    assert_eq!(json_of(&err)["error"]["code"], "context_length_exceeded");
    // The model's 4,096 positions, named, and the request's max_tokens.
    assert!(
        err.contains("max_position_embeddings") && err.contains("4096") && err.contains("100000"),
        "{err}"
    );
    drop(s);
    // Disaggregated: a ctx rank prefills and samples the first token, a gen rank decodes
    // from the K/V that moved between them; the text is the same.
    let s = Server::start("model/disagg-tiny.toml", &["--model", &dir_arg]);
    for i in 0..12 {
        let message = format!("Question {i}: what is the paged KV cache?");
        let (_, expected, (finish, completion)) = expect(&message);
        let v = chat_answer(&s, &message, MAX_TOKENS);
        assert_eq!(
            v["choices"][0]["message"]["content"],
            expected.as_str(),
            "disaggregated: {message}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{message}");
        assert_eq!(v["usage"]["completion_tokens"], completion);
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --model`, per request: the same `seed` and `temperature` give the same text
/// every time, another seed other text across a dozen prompts; `temperature: 0` is the
/// greedy reference; a field out of range is a 400 naming it.
#[test]
fn a_models_per_request_sampling_follows_the_body() {
    use lockstep_gpu::model::{InitOptions, Model, TextTokenizer, greedy_reference};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-sampling-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let dir_arg = dir.to_string_lossy().into_owned();
    // The server samples at temperature 1 unless a request says otherwise.
    let s = Server::start(
        "model/agg-tiny.toml",
        &["--model", &dir_arg, "--temperature", "1"],
    );
    let complete = |prompt: &str, extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 12});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 200, "{answer}");
        json_of(&answer)["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string()
    };
    let mut differ = 0;
    for i in 0..12 {
        let prompt = format!("sample number {i}");
        let a = complete(&prompt, json!({"seed": 11, "top_p": 0.95}));
        let again = complete(&prompt, json!({"seed": 11, "top_p": 0.95}));
        assert_eq!(a, again, "the same seed, the same text");
        if complete(&prompt, json!({"seed": 12, "top_p": 0.95})) != a {
            differ += 1;
        }
    }
    assert!(
        differ >= 8,
        "another seed changed only {differ} of 12 answers"
    );
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let prompt = tokenizer.encode_prompt("greedy please").expect("encode");
    let eos: Vec<u32> = model.config.eos_token_ids.clone();
    let ids = greedy_reference(&model, &prompt, 12).expect("reference");
    let shown = match ids.iter().position(|t| eos.contains(t)) {
        Some(end) => &ids[..end],
        None => &ids[..],
    };
    assert_eq!(
        complete("greedy please", json!({"temperature": 0})),
        tokenizer.decode(shown).expect("decode")
    );
    for (field, value) in [
        ("top_p", json!(1.5)),
        ("temperature", json!(-1)),
        ("top_k", json!(-2)),
    ] {
        let body = json!({"prompt": "x", field: value}).to_string();
        let (code, err) = post(&s.url("/v1/completions"), &body, None);
        assert_eq!(code, 400, "{err}");
        assert_eq!(json_of(&err)["error"]["param"], field, "{err}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --model`: a chat without `max_tokens` runs to the end of the model's context
/// (vLLM's default); `ignore_eos` passes over the end of sequence, so the answer is the
/// greedy reference to the last position; fields lockstep does not implement are a 400
/// naming them, not a 200 that ignores them; `/v1/models` gives `max_model_len` and
/// `root`, and `/ping` and `/version` answer.
#[test]
fn a_models_chat_defaults_to_its_context_and_unimplemented_fields_are_refused() {
    use lockstep_gpu::model::{InitOptions, Model, TextTokenizer, greedy_reference};
    const POSITIONS: usize = 64;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-fields-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let config_path = dir.join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config")).unwrap();
    config["max_position_embeddings"] = POSITIONS.into();
    std::fs::write(&config_path, config.to_string()).expect("write config");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let ends: Vec<u32> = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    // A message whose greedy answer reaches an end of sequence before the context ends,
    // so that ignore_eos has something to pass over.
    let (message, prompt, ids) = (0..40)
        .find_map(|i| {
            let message = format!("Question {i}: what is the paged KV cache?");
            let prompt = tokenizer
                .encode(
                    &tokenizer
                        .chat_prompt_messages(&[("user".into(), message.clone())])
                        .expect("the chat template"),
                )
                .expect("encode");
            let ids =
                greedy_reference(&model, &prompt, POSITIONS - prompt.len()).expect("reference");
            let end = ids.iter().position(|t| ends.contains(t))?;
            (end + 1 < ids.len()).then_some((message, prompt, ids))
        })
        .expect("some greedy answer ends early");
    let left = POSITIONS - prompt.len();
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start("model/agg-tiny.toml", &["--model", &dir_arg]);
    // vLLM's routes: /v1/models names the context and the directory; /ping, /version.
    let (code, models) = get(&s.url("/v1/models"));
    assert_eq!(code, 200, "{models}");
    let served = &json_of(&models)["data"][0];
    assert_eq!(served["max_model_len"], POSITIONS, "{models}");
    assert_eq!(served["root"], dir_arg.as_str(), "{models}");
    assert_eq!(get(&s.url("/ping")).0, 200);
    assert_eq!(post(&s.url("/ping"), "", None).0, 200);
    let (code, version) = get(&s.url("/version"));
    assert_eq!(code, 200);
    assert_eq!(json_of(&version)["version"], env!("CARGO_PKG_VERSION"));
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": message.as_str()}]});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        post(&s.url("/v1/chat/completions"), &body.to_string(), None)
    };
    let (code, answer) = chat(json!({"ignore_eos": true}));
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{answer}");
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["usage"]["completion_tokens"], left, "{answer}");
    // (A last byte-level token that ends inside a character is held back, as ever.)
    let expected = tokenizer.decode(&ids).expect("decode");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        expected.trim_end_matches('\u{FFFD}')
    );
    // Without ignore_eos the same request ends at the end of sequence.
    let (code, answer) = chat(json!({}));
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    let end = ids.iter().position(|t| ends.contains(t)).expect("an end");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{answer}");
    assert_eq!(v["usage"]["completion_tokens"], end + 1, "{answer}");
    for (field, value) in [
        ("top_logprobs", json!(2)),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("response_format", json!({"type": "json_object"})),
        ("echo", json!(true)),
        ("best_of", json!(2)),
    ] {
        let (code, err) = chat(json!({ field: value }));
        assert_eq!(code, 400, "{field}: {err}");
        assert_eq!(json_of(&err)["error"]["param"], field, "{err}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// vLLM's `/tokenize` and `/detokenize` on `serve --model`: a prompt's ids are what
/// `/v1/completions` feeds the model (its special tokens included), a chat's what
/// `/v1/chat/completions` does (its `prompt_tokens`), the token strings the vocabulary's,
/// ids back to text; bad input and unimplemented fields a 400 naming the field. Without a
/// model both routes say they need one. A method a route does not take is 405 with an
/// `Allow` header, not 404.
#[test]
fn tokenize_and_detokenize_give_the_models_ids_and_text_and_a_wrong_method_is_405() {
    use lockstep_gpu::model::{InitOptions, TextTokenizer};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-tokenize-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    // A tokenizer whose post-processor adds a BOS, so that a plain prompt's ids differ
    // from the text's as written.
    let bos = "<|endoftext|>";
    let path = dir.join("tokenizer.json");
    let mut with_bos: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("tokenizer.json")).unwrap();
    with_bos["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}},
    });
    std::fs::write(&path, with_bos.to_string()).expect("write tokenizer.json");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start("model/agg-tiny.toml", &["--model", &dir_arg]);
    let text = "the paged KV cache, spelled out";
    let (code, answer) = post(
        &s.url("/tokenize"),
        &json!({"prompt": text}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    let ids = tokenizer.encode_prompt(text).expect("encode");
    assert_eq!(v["tokens"], json!(ids), "{answer}");
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["token_strs"], Value::Null);
    // The same count as a completion's prompt_tokens.
    let (code, done) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": text, "max_tokens": 1}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{done}");
    assert_eq!(json_of(&done)["usage"]["prompt_tokens"], ids.len());
    // Without the special tokens, and with the token strings.
    let (code, answer) = post(
        &s.url("/tokenize"),
        &json!({"prompt": text, "add_special_tokens": false, "return_token_strs": true})
            .to_string(),
        None,
    );
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    let plain = tokenizer.encode(text).expect("encode");
    assert_eq!(v["tokens"], json!(plain));
    assert_eq!(ids[0], 256, "the post-processor's BOS");
    assert_eq!(ids[1..], plain[..]);
    let strs: Vec<String> = plain
        .iter()
        .map(|&id| tokenizer.token_string(id).expect("in the vocabulary"))
        .collect();
    assert_eq!(v["token_strs"], json!(strs));
    // A chat: the ids of its rendered template, as many as a chat completion's prompt.
    let messages = json!([{"role": "user", "content": "what is a block table?"}]);
    let (code, answer) = post(
        &s.url("/tokenize"),
        &json!({"messages": messages}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    let rendered = tokenizer
        .chat_prompt_messages(&[("user".into(), "what is a block table?".into())])
        .expect("the chat template");
    let chat_ids = tokenizer.encode(&rendered).expect("encode");
    assert_eq!(v["tokens"], json!(chat_ids));
    let (code, done) = post(
        &s.url("/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 1}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{done}");
    assert_eq!(json_of(&done)["usage"]["prompt_tokens"], chat_ids.len());
    // Back to text, special tokens written out.
    let (code, answer) = post(
        &s.url("/detokenize"),
        &json!({"tokens": chat_ids}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{answer}");
    assert_eq!(json_of(&answer)["prompt"], rendered.as_str());
    // Bad input and unimplemented fields, each named.
    for (route, body, param) in [
        ("/detokenize", json!({"tokens": [1, 1_000_000]}), "tokens"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "return_token_strs": 1}),
            "return_token_strs",
        ),
        (
            "/tokenize",
            json!({"messages": messages, "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            "/tokenize",
            json!({"messages": messages, "chat_template": "{{ x }}"}),
            "chat_template",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "model": "other"}),
            "model",
        ),
    ] {
        let (code, err) = post(&s.url(route), &body.to_string(), None);
        assert!(code == 400 || code == 404, "{route} {body}: {code} {err}");
        assert_eq!(
            json_of(&err)["error"]["param"],
            param,
            "{route} {body}: {err}"
        );
    }
    // A wrong method: 405, saying which methods the route takes.
    for (method, route, allow) in [
        ("DELETE", "/v1/completions", "POST"),
        ("GET", "/tokenize", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PUT", "/ping", "GET, POST"),
    ] {
        let url = s.url(route);
        let (code, allowed, body) = match agent().request(method, &url).call() {
            Ok(r) => (
                r.status(),
                r.header("Allow").map(str::to_string),
                String::new(),
            ),
            Err(ureq::Error::Status(code, r)) => (
                code,
                r.header("Allow").map(str::to_string),
                r.into_string().expect("a body"),
            ),
            Err(e) => panic!("{method} {route}: {e}"),
        };
        assert_eq!(code, 405, "{method} {route}: {body}");
        assert_eq!(allowed.as_deref(), Some(allow), "{method} {route}");
        assert!(
            json_of(&body)["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(allow))
        );
    }
    assert_eq!(get(&s.url("/no/such/route")).0, 404);
    drop(s);
    // Without a model there is no tokenizer: both routes say so.
    let s = Server::start("agg-balanced.toml", &[]);
    for route in ["/tokenize", "/detokenize"] {
        let (code, err) = post(&s.url(route), r#"{"prompt": "a", "tokens": [1]}"#, None);
        assert_eq!(code, 400, "{route}: {err}");
        assert!(err.contains("--model"), "{route}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --model` with `logit_bias`, the penalties and `min_tokens`: every answer is the
/// greedy text of the dense forward whose logits this test changes itself, step by step,
/// by the fields' formulas (bias added; repetition over prompt and output, then
/// frequency and presence over the output; the end ids at −∞ before `min_tokens`); each
/// field changes the plain greedy answer; aggregated and disaggregated. Bad values are a
/// 400 naming the field and the value, and the server goes on answering.
/// A change the test makes to a step's logits: (logits, prompt, output so far).
type LogitsAdjust<'a> = dyn Fn(&mut [f32], &[u32], &[u32]) + 'a;

#[test]
fn a_models_logit_bias_penalties_and_min_tokens_follow_the_dense_forward() {
    use lockstep_gpu::model::{
        DenseSequence, InitOptions, Model, TextTokenizer, argmax, forward_dense,
    };
    const MAX_TOKENS: usize = 24;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-rules-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let ends: Vec<u32> = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    let vocab = model.config.vocab_size;
    // Greedy over the dense forward, `adjust(logits, prompt, output so far)` applied
    // before each argmax; ends at an end id or at `MAX_TOKENS`.
    let reference = |prompt: &[u32], adjust: &LogitsAdjust<'_>| {
        let mut sequence = [DenseSequence::new(&model)];
        let mut logits = forward_dense(&model, &mut sequence, &[prompt]).expect("forward");
        let mut out = Vec::new();
        loop {
            adjust(&mut logits[0], prompt, &out);
            let token = argmax(&logits[0]);
            out.push(token);
            if out.len() == MAX_TOKENS || ends.contains(&token) {
                return out;
            }
            logits = forward_dense(&model, &mut sequence, &[&[token]]).expect("forward");
        }
    };
    // (text, completion tokens, finish) the server must answer for reference ids.
    let answer_of = |ids: &[u32]| {
        let ended = ends.contains(ids.last().expect("a token"));
        let shown = if ended { &ids[..ids.len() - 1] } else { ids };
        let text = tokenizer.decode(shown).expect("decode");
        (
            text.trim_end_matches('\u{FFFD}').to_string(),
            ids.len(),
            if ended { "stop" } else { "length" },
        )
    };
    let plain = |_: &mut [f32], _: &[u32], _: &[u32]| {};
    let penalise = |logits: &mut [f32], prompt: &[u32], out: &[u32]| {
        let (presence, frequency, repetition) = (0.5f32, 1.5f32, 1.8f32);
        let mut seen: Vec<u32> = prompt.iter().chain(out).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 {
                *l / repetition
            } else {
                *l * repetition
            };
        }
        let mut counted: Vec<u32> = out.to_vec();
        counted.sort_unstable();
        counted.dedup();
        for t in counted {
            let count = out.iter().filter(|&&o| o == t).count() as f32;
            logits[t as usize] -= frequency * count + presence;
        }
    };
    let prompts: Vec<String> = (0..6)
        .map(|i| format!("rule number {i} of the test"))
        .collect();
    let dir_arg = dir.to_string_lossy().into_owned();
    for scenario in ["model/agg-tiny.toml", "model/disagg-tiny.toml"] {
        let s = Server::start(scenario, &["--model", &dir_arg]);
        let complete = |prompt: &str, extra: Value| {
            let mut body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS});
            for (k, v) in extra.as_object().expect("an object") {
                body[k] = v.clone();
            }
            let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{answer}");
            let v = json_of(&answer);
            (
                v["choices"][0]["text"].as_str().expect("text").to_string(),
                v["usage"]["completion_tokens"].as_u64().expect("usage") as usize,
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .expect("finish")
                    .to_string(),
            )
        };
        let (mut bias_changed, mut penalty_changed, mut presence_changed) = (0, 0, 0);
        for prompt in &prompts {
            let ids = tokenizer.encode_prompt(prompt).expect("encode");
            let greedy = reference(&ids, &plain);
            // The greedy first token is forbidden and another favoured.
            let (banned, favoured) = (greedy[0], (greedy[0] as usize + 7) % vocab);
            let biased = reference(&ids, &|l: &mut [f32], _: &[u32], _: &[u32]| {
                l[banned as usize] += -100.0;
                l[favoured] += 3.0;
            });
            let got = complete(
                prompt,
                json!({"logit_bias": {banned.to_string(): -100, favoured.to_string(): 3}}),
            );
            let (text, tokens, finish) = answer_of(&biased);
            assert_eq!(
                got,
                (text, tokens, finish.to_string()),
                "{scenario}: {prompt}"
            );
            bias_changed += usize::from(biased != greedy);
            let penalised = reference(&ids, &penalise);
            let got = complete(
                prompt,
                json!({"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.8}),
            );
            let (text, tokens, finish) = answer_of(&penalised);
            assert_eq!(
                got,
                (text, tokens, finish.to_string()),
                "{scenario}: {prompt}"
            );
            penalty_changed += usize::from(penalised != greedy);
            // Presence alone: `logit -= 2` once for every token the output holds.
            let present = reference(&ids, &|l: &mut [f32], _: &[u32], out: &[u32]| {
                let mut seen = out.to_vec();
                seen.sort_unstable();
                seen.dedup();
                for t in seen {
                    l[t as usize] -= 2.0;
                }
            });
            let got = complete(prompt, json!({"presence_penalty": 2}));
            let (text, tokens, finish) = answer_of(&present);
            assert_eq!(
                got,
                (text, tokens, finish.to_string()),
                "{scenario}: {prompt}"
            );
            presence_changed += usize::from(present != greedy);
            // Neutral values, spelled out, are the plain greedy answer.
            let got = complete(
                prompt,
                json!({"logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1, "min_tokens": 0}),
            );
            let (text, tokens, finish) = answer_of(&greedy);
            assert_eq!(
                got,
                (text, tokens, finish.to_string()),
                "{scenario}: {prompt}"
            );
        }
        assert_eq!(
            bias_changed,
            prompts.len(),
            "the bias bans the greedy first token"
        );
        assert!(penalty_changed > 0, "the penalties changed no answer");
        assert!(
            presence_changed > 0,
            "the presence penalty changed no answer"
        );
        // min_tokens: a prompt whose greedy answer ends early gets no end id before it.
        let (prompt, ids, end) = (0..60)
            .find_map(|i| {
                let prompt = format!("end early {i}");
                let ids = tokenizer.encode_prompt(&prompt).expect("encode");
                let greedy = reference(&ids, &plain);
                (ends.contains(greedy.last()?) && greedy.len() + 2 <= MAX_TOKENS).then_some((
                    prompt,
                    ids,
                    greedy.len(),
                ))
            })
            .expect("some greedy answer ends early");
        let min_tokens = end + 2;
        let masked = reference(&ids, &|l: &mut [f32], _: &[u32], out: &[u32]| {
            if out.len() < min_tokens {
                for &t in &ends {
                    l[t as usize] = f32::NEG_INFINITY;
                }
            }
        });
        let got = complete(&prompt, json!({"min_tokens": min_tokens}));
        assert!(got.1 >= min_tokens, "{scenario}: {got:?}");
        let (text, tokens, finish) = answer_of(&masked);
        assert_eq!(
            got,
            (text, tokens, finish.to_string()),
            "{scenario}: {prompt}"
        );
        // Bad values: a 400 naming the field and the value.
        for (field, value, named) in [
            (
                "logit_bias",
                json!({(vocab + 5).to_string(): 1}),
                (vocab + 5).to_string(),
            ),
            ("logit_bias", json!({"3": 101}), "101".to_string()),
            ("presence_penalty", json!(-2.5), "-2.5".to_string()),
            ("repetition_penalty", json!(-1), "-1".to_string()),
            (
                "min_tokens",
                json!(MAX_TOKENS + 1),
                (MAX_TOKENS + 1).to_string(),
            ),
        ] {
            let body = json!({"prompt": "x", "max_tokens": MAX_TOKENS, field: value}).to_string();
            let (code, err) = post(&s.url("/v1/completions"), &body, None);
            assert_eq!(code, 400, "{err}");
            let e = &json_of(&err)["error"];
            assert_eq!(e["param"], field, "{err}");
            assert!(
                e["message"].as_str().expect("a message").contains(&named),
                "{err}"
            );
        }
        // A chat's min_tokens past what the context leaves is refused too.
        let body = json!({"messages": [{"role": "user", "content": "x"}], "min_tokens": 1_000_000})
            .to_string();
        let (code, err) = post(&s.url("/v1/chat/completions"), &body, None);
        assert_eq!(code, 400, "{err}");
        assert_eq!(json_of(&err)["error"]["param"], "min_tokens", "{err}");
        // Still serving.
        assert_eq!(complete(&prompt, json!({})).1, end);
        drop(s);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One greedy step of the dense reference: the token and the log-softmax (f64) of the
/// logits it was chosen from.
struct RefStep {
    token: u32,
    logprobs: Vec<f64>,
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let norm = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&l| l as f64 - norm).collect()
}

/// The ids of the `k` largest of `logprobs`, largest first.
fn top_ids(logprobs: &[f64], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logprobs.len() as u32).collect();
    ids.sort_by(|&a, &b| logprobs[b as usize].total_cmp(&logprobs[a as usize]));
    ids.truncate(k);
    ids
}

fn close(got: &Value, want: f64, what: &str) {
    let got = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: not a number: {got}"));
    assert!((got - want).abs() < 1e-4, "{what}: {got} vs {want}");
}

/// `serve --model` with `logprobs`: every output token's log-probability is the
/// log-softmax of the dense forward's logits at its position (within 1e-4), the top k
/// are the k most likely in order, on completions (whole and streamed, `top_logprobs`
/// dicts with `text_offset`) and chat (`logprobs.content`, streamed and whole); with a
/// `logit_bias` the sampled token changes but its logprob stays the raw model's (vLLM's
/// default); `echo` puts the prompt first, and with `logprobs` the prompt's tokens'
/// log-probabilities (the first token none) before the answer's; k above 20 is a 400
/// naming the field; without a model logprobs are a 400 saying no forward runs.
#[test]
fn a_models_logprobs_are_the_dense_forwards_log_softmax() {
    use lockstep_gpu::model::{DenseSequence, InitOptions, Model, TextTokenizer, forward_dense};
    const MAX_TOKENS: usize = 10;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-logprobs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let ends: Vec<u32> = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    // Greedy over the dense forward, `bias` added to one token's logit before the
    // argmax (the logprobs are of the logits before it).
    let reference = |prompt: &[u32], bias: Option<(u32, f32)>| {
        let mut sequence = [DenseSequence::new(&model)];
        let mut logits = forward_dense(&model, &mut sequence, &[prompt]).expect("forward");
        let mut steps = Vec::new();
        loop {
            let logprobs = log_softmax(&logits[0]);
            let mut chosen = logits[0].clone();
            if let Some((t, b)) = bias {
                chosen[t as usize] += b;
            }
            let token = lockstep_gpu::model::argmax(&chosen);
            steps.push(RefStep { token, logprobs });
            if steps.len() == MAX_TOKENS || ends.contains(&token) {
                return steps;
            }
            logits = forward_dense(&model, &mut sequence, &[&[token]]).expect("forward");
        }
    };
    let text_of = |id: u32| tokenizer.token_text(id).expect("token text");
    // A completions `logprobs` object against the reference, k top tokens asked.
    let check_completion = |lp: &Value, steps: &[RefStep], k: usize, what: &str| {
        let tokens = lp["tokens"].as_array().expect("tokens");
        assert_eq!(tokens.len(), steps.len(), "{what}: {lp}");
        let mut offset = 0;
        for (i, step) in steps.iter().enumerate() {
            assert_eq!(tokens[i], text_of(step.token).as_str(), "{what}");
            let own = step.logprobs[step.token as usize];
            close(&lp["token_logprobs"][i], own, what);
            assert_eq!(lp["text_offset"][i], offset, "{what}");
            offset += text_of(step.token).chars().count();
            let top = lp["top_logprobs"][i].as_object().expect("a dict");
            let want = top_ids(&step.logprobs, k);
            assert!(top.len() <= k + 1, "{what}: {top:?}");
            for id in want.iter().copied().chain([step.token]) {
                let t = text_of(id);
                // Two ids of one text share a key: only a text of one id is checked.
                if want.iter().filter(|&&w| text_of(w) == t).count() <= 1 {
                    close(&top[&t], step.logprobs[id as usize], what);
                }
            }
        }
    };
    // Chat's `logprobs.content` entries against the reference.
    let check_chat = |content: &[Value], steps: &[RefStep], k: usize, what: &str| {
        assert_eq!(content.len(), steps.len(), "{what}");
        for (entry, step) in content.iter().zip(steps) {
            let t = text_of(step.token);
            assert_eq!(entry["token"], t.as_str(), "{what}");
            assert_eq!(entry["bytes"], json!(t.as_bytes()), "{what}");
            close(&entry["logprob"], step.logprobs[step.token as usize], what);
            let top = entry["top_logprobs"].as_array().expect("top");
            let want = top_ids(&step.logprobs, k);
            assert_eq!(top.len(), k, "{what}");
            for (got, id) in top.iter().zip(want) {
                assert_eq!(got["token"], text_of(id).as_str(), "{what}");
                close(&got["logprob"], step.logprobs[id as usize], what);
            }
            let ordered = top
                .windows(2)
                .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64());
            assert!(ordered, "{what}: {top:?}");
        }
    };
    let streamed = |events: &str| -> Vec<Value> {
        events
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(json_of)
            .collect()
    };
    let dir_arg = dir.to_string_lossy().into_owned();
    // Disaggregated, the first token's logprobs come from the ctx server.
    for scenario in ["model/disagg-tiny.toml", "model/agg-tiny.toml"] {
        let s = Server::start(scenario, &["--model", &dir_arg]);
        let mut biased_changed = 0;
        for i in 0..3 {
            let prompt = format!("logprobs prompt {i} of the test");
            let ids = tokenizer.encode_prompt(&prompt).expect("encode");
            let steps = reference(&ids, None);
            let what = format!("completion {i}");
            let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 3});
            let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{answer}");
            let v = json_of(&answer);
            assert_eq!(v["usage"]["completion_tokens"], steps.len(), "{answer}");
            check_completion(&v["choices"][0]["logprobs"], &steps, 3, &what);
            // Streamed with k = 0: each chunk with a token carries its logprob alone.
            let mut body = body;
            body["stream"] = json!(true);
            body["logprobs"] = json!(0);
            let (code, events) = post(&s.url("/v1/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{events}");
            let mut merged =
                json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
            for c in streamed(&events) {
                let lp = &c["choices"][0]["logprobs"];
                if lp.is_null() {
                    continue;
                }
                for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                    let items = lp[key].as_array().expect("a list").clone();
                    merged[key].as_array_mut().expect("a list").extend(items);
                }
            }
            check_completion(&merged, &steps, 0, &format!("streamed {what}"));
            // A bias that bans the greedy first token: another is sampled, its logprob the
            // raw model's (not the biased logits').
            let banned = steps[0].token;
            let biased = reference(&ids, Some((banned, -100.0)));
            let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2,
            "logit_bias": {banned.to_string(): -100}});
            let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{answer}");
            check_completion(
                &json_of(&answer)["choices"][0]["logprobs"],
                &biased,
                2,
                "biased",
            );
            biased_changed += usize::from(biased[0].token != banned);
            // Chat: logprobs true with top_logprobs 2, whole and streamed.
            let message = format!("logprobs message {i}");
            let chat_ids = tokenizer
                .encode(
                    &tokenizer
                        .chat_prompt_messages(&[("user".into(), message.clone())])
                        .expect("the chat template"),
                )
                .expect("encode");
            let chat_steps = reference(&chat_ids, None);
            let body = json!({"messages": [{"role": "user", "content": message}],
            "max_tokens": MAX_TOKENS, "logprobs": true, "top_logprobs": 2});
            let (code, answer) = post(&s.url("/v1/chat/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{answer}");
            let v = json_of(&answer);
            let content = v["choices"][0]["logprobs"]["content"]
                .as_array()
                .expect("content");
            check_chat(content, &chat_steps, 2, &format!("chat {i}"));
            let mut body = body;
            body["stream"] = json!(true);
            let (code, events) = post(&s.url("/v1/chat/completions"), &body.to_string(), None);
            assert_eq!(code, 200, "{events}");
            let content: Vec<Value> = streamed(&events)
                .iter()
                .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
                .flatten()
                .collect();
            check_chat(&content, &chat_steps, 2, &format!("streamed chat {i}"));
            // Without logprobs: null, as before.
            let body = json!({"prompt": prompt, "max_tokens": 2});
            let (_, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
            assert!(
                json_of(&answer)["choices"][0]["logprobs"].is_null(),
                "{answer}"
            );
        }
        assert_eq!(
            biased_changed, 3,
            "{scenario}: the bias changed every first token"
        );
        // Concurrent requests share batches: each gets its own entry's numbers.
        let prompts: Vec<String> = (0..6).map(|i| format!("together {i}, at once")).collect();
        let expected: Vec<Vec<RefStep>> = prompts
            .iter()
            .map(|p| reference(&tokenizer.encode_prompt(p).expect("encode"), None))
            .collect();
        let answers: Vec<Value> = std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    let url = s.url("/v1/completions");
                    let body = json!({"prompt": p, "max_tokens": MAX_TOKENS, "logprobs": k % 3});
                    scope.spawn(move || {
                        let (code, answer) = post(&url, &body.to_string(), None);
                        assert_eq!(code, 200, "{answer}");
                        json_of(&answer)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a request"))
                .collect()
        });
        for (k, (v, steps)) in answers.iter().zip(&expected).enumerate() {
            let what = format!("{scenario}: concurrent {k}");
            check_completion(&v["choices"][0]["logprobs"], steps, k % 3, &what);
        }
        if scenario.contains("disagg") {
            continue;
        }
        // echo: the prompt first, whole and streamed.
        let body = json!({"prompt": "echo this", "max_tokens": 3, "echo": true});
        let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 200, "{answer}");
        let plain = json!({"prompt": "echo this", "max_tokens": 3});
        let (_, plain) = post(&s.url("/v1/completions"), &plain.to_string(), None);
        let plain = json_of(&plain)["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string();
        assert_eq!(
            json_of(&answer)["choices"][0]["text"],
            format!("echo this{plain}")
        );
        let mut body = body;
        body["stream"] = json!(true);
        let (_, events) = post(&s.url("/v1/completions"), &body.to_string(), None);
        let text: String = streamed(&events)
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(text, format!("echo this{plain}"));
        // echo with logprobs: the prompt's tokens first, the first with none, each other
        // with its log-probability given those before it (the dense forward fed one
        // token at a time, the server's one forward over the whole prompt), then the
        // answer's; streamed the same.
        let prompt = "echo these prompt tokens with their logprobs";
        let ids = tokenizer.encode_prompt(prompt).expect("encode");
        assert!(ids.len() > 4, "{ids:?}");
        let mut sequence = [DenseSequence::new(&model)];
        let mut prompt_steps = Vec::new();
        for pair in ids.windows(2) {
            let logits = forward_dense(&model, &mut sequence, &[&pair[..1]]).expect("forward");
            prompt_steps.push(RefStep {
                token: pair[1],
                logprobs: log_softmax(&logits[0]),
            });
        }
        let steps = reference(&ids, None);
        let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, "echo": true});
        let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 200, "{answer}");
        let whole = json_of(&answer)["choices"][0]["logprobs"].clone();
        let check_echo = |lp: &Value, what: &str| {
            let tokens = lp["tokens"].as_array().expect("tokens");
            assert_eq!(tokens.len(), ids.len() + steps.len(), "{what}: {lp}");
            assert_eq!(tokens[0], text_of(ids[0]).as_str(), "{what}");
            assert!(lp["token_logprobs"][0].is_null(), "{what}: {lp}");
            assert!(lp["top_logprobs"][0].is_null(), "{what}: {lp}");
            let mut offset = text_of(ids[0]).chars().count();
            for (i, step) in prompt_steps.iter().enumerate() {
                let at = i + 1;
                assert_eq!(tokens[at], text_of(step.token).as_str(), "{what}");
                close(
                    &lp["token_logprobs"][at],
                    step.logprobs[step.token as usize],
                    what,
                );
                assert_eq!(lp["text_offset"][at], offset, "{what}");
                offset += text_of(step.token).chars().count();
                let top = lp["top_logprobs"][at].as_object().expect("a dict");
                for id in top_ids(&step.logprobs, 2) {
                    let t = text_of(id);
                    if top_ids(&step.logprobs, 2)
                        .iter()
                        .filter(|&&w| text_of(w) == t)
                        .count()
                        == 1
                    {
                        close(&top[&t], step.logprobs[id as usize], what);
                    }
                }
            }
            for (i, step) in steps.iter().enumerate() {
                let at = ids.len() + i;
                assert_eq!(tokens[at], text_of(step.token).as_str(), "{what}");
                close(
                    &lp["token_logprobs"][at],
                    step.logprobs[step.token as usize],
                    what,
                );
            }
        };
        check_echo(&whole, "echo with logprobs");
        let mut body = body;
        body["stream"] = json!(true);
        let (code, events) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 200, "{events}");
        let mut merged =
            json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
        for c in streamed(&events) {
            let lp = &c["choices"][0]["logprobs"];
            if lp.is_null() {
                continue;
            }
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let items = lp[key].as_array().expect("a list").clone();
                merged[key].as_array_mut().expect("a list").extend(items);
            }
        }
        assert_eq!(merged, whole, "streamed echo with logprobs");
        // Refusals name the field (and the value past 20).
        for (path, body, field, named) in [
            (
                "/v1/completions",
                json!({"prompt": "x", "logprobs": 21}),
                "logprobs",
                "21",
            ),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
                "21",
            ),
        ] {
            let (code, err) = post(&s.url(path), &body.to_string(), None);
            assert_eq!(code, 400, "{err}");
            let e = &json_of(&err)["error"];
            assert_eq!(e["param"], field, "{err}");
            assert!(
                e["message"].as_str().expect("a message").contains(named),
                "{err}"
            );
        }
    }
    // No model, no forward: refused, saying so.
    let sim = Server::start("agg-balanced.toml", &[]);
    let body = json!({"prompt": "x", "max_tokens": 2, "logprobs": 1});
    let (code, err) = post(&sim.url("/v1/completions"), &body.to_string(), None);
    assert_eq!(code, 400, "{err}");
    let e = &json_of(&err)["error"];
    assert_eq!(e["param"], "logprobs", "{err}");
    assert!(
        e["message"]
            .as_str()
            .expect("a message")
            .contains("no forward"),
        "{err}"
    );
    drop(sim);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A streamed completion of `max_tokens` whose client reads the head and the first
/// event, then nothing: zero-cost, its output fills the socket's buffers (a few MB on
/// loopback) within seconds and then waits on the client.
fn stalled_stream(s: &Server, max_tokens: u32) -> std::net::TcpStream {
    start_request(
        s,
        &json!({"prompt": "a b", "max_tokens": max_tokens, "stream": true}),
        true,
    )
}

/// Reads what is left of a connection (with a deadline): the bytes, and whether it
/// ended with an error (a reset) rather than an end of file.
fn read_rest(c: &mut std::net::TcpStream) -> (Vec<u8>, bool) {
    c.set_read_timeout(Some(DEADLINE)).expect("a timeout");
    let mut rest = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return (rest, false),
            Ok(n) => rest.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                assert_ne!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock,
                    "the connection stayed open"
                );
                return (rest, true);
            }
        }
    }
}

/// Reads a chunked stream's connection up to the stream's end (the last chunk, after
/// `data: [DONE]`), with a deadline.
fn read_stream_end(c: &mut std::net::TcpStream) -> Vec<u8> {
    c.set_read_timeout(Some(DEADLINE)).expect("a timeout");
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    while !seen.ends_with(b"data: [DONE]\n\n\r\n0\r\n\r\n") {
        let n = c.read(&mut buf).expect("the rest of the stream");
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    seen
}

/// The payload of an HTTP/1.1 response body sent chunked (the chunk sizes dropped).
fn dechunk(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out = String::new();
    let mut rest: &str = &text;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16)
            .unwrap_or_else(|_| panic!("not a chunk size: {size:?}"));
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
}

#[test]
fn a_stream_whose_client_stops_reading_is_cancelled_after_the_write_timeout() {
    let s = Server::start("agg-balanced.toml", &["--write-timeout-s", "1"]);
    // 200,000 tokens take far longer than the test: the request still runs when the
    // client has read nothing for the timeout.
    let mut c = stalled_stream(&s, 200_000);
    let after = scrape_until(&s, |m| {
        sample(m, "lockstep_request_cancelled_total") == 1.0
            && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
            && over_ranks(m, "lockstep_rank_requests_resident") == 0.0
    });
    assert_eq!(
        sample(&after, "lockstep_request_cancelled_total"),
        1.0,
        "a client that stopped reading was not cut off: {after:?}"
    );
    assert_eq!(sample(&after, "lockstep_request_stalled_total"), 1.0);
    assert_eq!(over_ranks(&after, "lockstep_kv_cache_used_blocks"), 0.0);
    assert_eq!(sample(&after, "lockstep_request_success_total"), 0.0);
    assert_eq!(sample(&after, "lockstep_num_requests_pending"), 0.0);
    // Its connection was closed: what the kernel had buffered, then the end, never
    // the end of the stream.
    let (rest, _) = read_rest(&mut c);
    assert!(
        !String::from_utf8_lossy(&rest).contains("[DONE]"),
        "a stalled stream ended normally"
    );
    // The server goes on serving.
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
}

#[test]
fn a_stream_further_behind_than_its_buffer_is_cancelled_and_told_why() {
    // A write timeout longer than the test: only the buffer's bound can end it.
    let s = Server::start(
        "agg-balanced.toml",
        &["--write-timeout-s", "600", "--stream-buffer", "64"],
    );
    let mut c = stalled_stream(&s, 200_000);
    let after = scrape_until(&s, |m| {
        sample(m, "lockstep_request_cancelled_total") == 1.0
            && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
    });
    assert_eq!(
        sample(&after, "lockstep_request_cancelled_total"),
        1.0,
        "a stream 64 events behind was not cancelled: {after:?}"
    );
    assert_eq!(over_ranks(&after, "lockstep_kv_cache_used_blocks"), 0.0);
    assert_eq!(sample(&after, "lockstep_request_stalled_total"), 0.0);
    // The client reads again: what was buffered, an error event naming the bound, the
    // end.
    let text = String::from_utf8_lossy(&read_stream_end(&mut c)).into_owned();
    let at = text.rfind("data: {\"error\"").expect("an error event");
    let error = json_of(&text[at + 6..at + text[at..].find("\n\n").expect("an event")]);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--stream-buffer")),
        "{error}"
    );
}

#[test]
fn max_pending_holds_a_place_until_the_answer_is_delivered() {
    // The whole output fits the stream's buffer: the request ends on its rank long before
    // its client has read it.
    let s = Server::start(
        "agg-balanced.toml",
        &["--max-pending", "1", "--stream-buffer", "100000"],
    );
    let mut c = stalled_stream(&s, 40_000);
    let ended = scrape_until(&s, |m| sample(m, "lockstep_request_success_total") == 1.0);
    assert_eq!(sample(&ended, "lockstep_request_success_total"), 1.0);
    // Generated, not delivered: its place is still taken.
    let refused = agent()
        .post(&s.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(r#"{"prompt": "a", "max_tokens": 2}"#);
    assert!(
        matches!(refused, Err(ureq::Error::Status(429, _))),
        "a second request was taken while the first was undelivered: {refused:?}"
    );
    // Once its client has read it all, the place is free again.
    let text = read_stream_end(&mut c);
    assert!(!String::from_utf8_lossy(&text).contains("\"error\""));
    let free = scrape_until(&s, |m| sample(m, "lockstep_num_requests_pending") == 0.0);
    assert_eq!(sample(&free, "lockstep_num_requests_pending"), 0.0);
    let (code, body) = post(
        &s.url("/v1/completions"),
        r#"{"prompt": "a", "max_tokens": 2}"#,
        None,
    );
    assert_eq!(code, 200, "{body}");
}

#[test]
fn requests_cut_by_the_drain_timeout_get_an_error_and_the_exit_status_says_so() {
    // Paced by the model: 2,000 tokens take far longer than the 1 s drain.
    let mut s = Server::start(
        "agg-balanced.toml",
        &["--time-scale", "1", "--drain-timeout-s", "1"],
    );
    let long =
        |stream: bool| json!({"prompt": "a b c", "max_tokens": 2000, "stream": stream}).to_string();
    let resp = agent()
        .post(&s.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&long(true))
        .expect("the stream starts");
    let mut reader = BufReader::new(resp.into_reader());
    let mut first = String::new();
    reader.read_line(&mut first).expect("a first event");
    let url = s.url("/v1/completions");
    let whole = std::thread::spawn(move || {
        match agent()
            .post(&url)
            .set("Content-Type", "application/json")
            .send_string(&long(false))
        {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    });
    scrape_until(&s, |m| sample(m, "lockstep_num_requests_running") == 2.0);
    s.signal("TERM");
    let mut rest = String::new();
    let read = reader.read_to_string(&mut rest);
    assert!(read.is_ok(), "the stream was cut without an end: {read:?}");
    let events = sse_events(&format!("{first}{rest}"));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error = json_of(&events[events.len() - 2]);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--drain-timeout-s")),
        "{error}"
    );
    let (code, body) = whole.join().expect("the whole answer's thread");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("--drain-timeout-s"), "{body}");
    let (status, out) = s.wait_exit();
    assert!(!status.success(), "an incomplete drain exited 0: {out:?}");
    assert!(
        out.iter().any(|l| l.contains("2 cut at the drain timeout")),
        "{out:?}"
    );
}

#[test]
fn a_client_that_half_closes_after_sending_still_gets_its_answer() {
    // Paced by the model: the half-close comes while the answer is generated.
    let s = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    for stream in [false, true] {
        let body = json!({"prompt": "a b c", "max_tokens": 40, "stream": stream}).to_string();
        let addr = s.base.trim_start_matches("http://");
        let mut c = std::net::TcpStream::connect(addr).expect("connecting");
        std::io::Write::write_all(
            &mut c,
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .expect("sending");
        c.shutdown(std::net::Shutdown::Write).expect("half-closing");
        let (answer, reset) = read_rest(&mut c);
        assert!(!reset, "stream {stream}: reset");
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("HTTP/1.1 200"), "stream {stream}: {head}");
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body.as_bytes())
        } else {
            body.to_string()
        };
        if stream {
            let events = sse_events(&body);
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        } else {
            let v = json_of(body.trim());
            assert_eq!(v["usage"]["completion_tokens"], 40, "{body}");
            assert_eq!(v["choices"][0]["finish_reason"], "length", "{body}");
        }
    }
    let after = scrape_until(&s, |m| sample(m, "lockstep_request_success_total") == 2.0);
    assert_eq!(sample(&after, "lockstep_request_success_total"), 2.0);
    assert_eq!(sample(&after, "lockstep_request_cancelled_total"), 0.0);
}

#[test]
fn streams_whose_clients_read_are_never_cut_off_by_their_buffer() {
    // Zero-cost: the fleet outruns the HTTP workers, so each stream falls far more than
    // its 8 events behind, while its client reads everything it is sent.
    let s = Server::start("agg-balanced.toml", &["--stream-buffer", "8"]);
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let url = s.url("/v1/completions");
            std::thread::spawn(move || {
                post(
                    &url,
                    &json!({"prompt": "a b", "max_tokens": 3000, "stream": true}).to_string(),
                    None,
                )
            })
        })
        .collect();
    for c in clients {
        let (code, body) = c.join().expect("a client");
        assert_eq!(code, 200, "{body}");
        let events = sse_events(&body);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let error = events.iter().find(|e| e.starts_with("{\"error\""));
        assert!(error.is_none(), "a reading client was cut off: {error:?}");
    }
    let after = scrape(&s);
    assert_eq!(sample(&after, "lockstep_request_cancelled_total"), 0.0);
    assert_eq!(sample(&after, "lockstep_request_success_total"), 16.0);
}

/// Issue 32 item 4: vLLM's names. `--served-model-name` names the model (the old
/// `--model-name` still works), `--max-model-len` bounds prompt plus max_tokens, and
/// `--max-num-batched-tokens` with `--no-enable-chunked-prefill` reach every server.
#[test]
fn vllm_engine_flags_name_the_model_and_set_the_fleet() {
    let s = Server::start(
        "agg-balanced.toml",
        &[
            "--served-model-name",
            "my-llm",
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "48",
            "--no-enable-chunked-prefill",
            "--data-parallel-size",
            "2",
        ],
    );
    let (code, body) = get(&s.url("/v1/models"));
    assert_eq!(code, 200, "{body}");
    let m = json_of(&body);
    assert_eq!(m["data"][0]["id"], "my-llm", "{m}");
    assert_eq!(m["data"][0]["max_model_len"], 64, "{m}");
    let words = |n: usize| vec!["w"; n].join(" ");
    // Within both limits: answered.
    let (code, body) = post(
        &s.url("/v1/completions"),
        &json!({"model": "my-llm", "prompt": words(40), "max_tokens": 8}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{body}");
    // Past --max-model-len: prompt 40 + max_tokens 30 > 64.
    let (code, body) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": words(40), "max_tokens": 30}).to_string(),
        None,
    );
    assert_eq!(code, 400, "{body}");
    let e = json_of(&body);
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert!(body.contains("--max-model-len"), "{body}");
    // A prompt past --max-num-batched-tokens 48 without chunked prefill: refused by the
    // fleet's own limit (before, T was the scenario's 8192 with chunking on).
    let (code, body) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": words(50), "max_tokens": 1}).to_string(),
        None,
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("max_num_tokens 48"), "{body}");
    // --data-parallel-size 2: two ranks where the scenario has four.
    let m = scrape_until(&s, |m| {
        m.iter()
            .any(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
    });
    let ranks = m
        .iter()
        .filter(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
        .count();
    assert_eq!(ranks, 2, "{m:?}");
    drop(s);
    // The old name still works.
    let s = Server::start("agg-balanced.toml", &["--model-name", "old-name"]);
    let (_, body) = get(&s.url("/v1/models"));
    assert_eq!(json_of(&body)["data"][0]["id"], "old-name", "{body}");
}

#[test]
fn bad_vllm_engine_flags_are_refused_naming_the_flag_and_the_field() {
    let agg = example("agg-balanced.toml");
    let disagg = example("disagg-small.toml");
    for (args, says) in [
        (
            vec![agg.as_str(), "--max-num-seqs", "0"],
            vec!["--max-num-seqs 0", "max_batch_size"],
        ),
        (
            vec![
                agg.as_str(),
                "--tensor-parallel-size",
                "2",
                "--data-parallel-size",
                "2",
            ],
            vec![
                "--tensor-parallel-size 2 --data-parallel-size 2",
                "one of the two must be 1",
            ],
        ),
        (
            vec![disagg.as_str(), "--data-parallel-size", "2"],
            vec!["--data-parallel-size 2", "2 servers", "--set server.NAME"],
        ),
        (
            vec![agg.as_str(), "--max-model-len", "0"],
            vec!["--max-model-len"],
        ),
    ] {
        let mut all = args.clone();
        all.extend(["--port", "0"]);
        let err = startup_failure(&all, &[]);
        for s in says {
            assert!(err.contains(s), "{args:?}: {err}");
        }
    }
}

/// `--max-num-seqs 1`: one request per forward, so six overlapping requests are
/// scheduled one at a time (without it B is the scenario's 32 and they share forwards).
#[test]
fn max_num_seqs_bounds_the_requests_in_one_forward() {
    let s = Server::start(
        "agg-balanced.toml",
        &[
            "--max-num-seqs",
            "1",
            "--data-parallel-size",
            "1",
            "--time-scale",
            "1",
        ],
    );
    let url = s.url("/v1/completions");
    let body = json!({"prompt": vec!["w"; 32].join(" "), "max_tokens": 8}).to_string();
    let posts: Vec<_> = (0..6)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || post(&url, &body, None))
        })
        .collect();
    for p in posts {
        let (code, body) = p.join().expect("a client thread");
        assert_eq!(code, 200, "{body}");
    }
    let m = scrape_until(&s, |m| {
        over_ranks(m, "lockstep_rank_routed_requests_total") == 6.0
            && over_ranks(m, "lockstep_rank_requests_resident") == 0.0
    });
    let scheduled = over_ranks(&m, "lockstep_rank_scheduled_requests_total");
    let iterations = over_ranks(&m, "lockstep_rank_iterations_total");
    assert!(scheduled >= 6.0, "{m:?}");
    assert!(
        scheduled <= iterations,
        "{scheduled} requests over {iterations} forwards: more than one per forward"
    );
}

/// The flags win over the scenario and its `--set`s (as vLLM's CLI over its config):
/// `--enable-chunked-prefill` turns chunking back on after `--set` turned it off, so a
/// prompt longer than `--max-num-batched-tokens` is taken; `--tensor-parallel-size 2`
/// makes one attention group (one series per attention-DP rank) where the scenario has
/// four.
#[test]
fn vllm_engine_flags_win_over_the_scenarios_sets() {
    let s = Server::start(
        "agg-balanced.toml",
        &[
            "--set",
            "server.enable_chunked_prefill=false",
            "--max-num-batched-tokens",
            "48",
            "--enable-chunked-prefill",
            "--tensor-parallel-size",
            "2",
        ],
    );
    let (code, body) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": vec!["w"; 50].join(" "), "max_tokens": 2}).to_string(),
        None,
    );
    assert_eq!(code, 200, "{body}");
    let m = scrape_until(&s, |m| {
        m.iter()
            .any(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
    });
    let ranks = m
        .iter()
        .filter(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
        .count();
    assert_eq!(ranks, 1, "{m:?}");
}

/// The `data:` events of a streamed answer, `[DONE]` left out.
fn sse_json(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(json_of)
        .collect()
}

/// `serve --model` with `n`: the sequences after the first reuse the prompt's KV
/// blocks (a one-rank server: the prefix-cache hit counter moves by the prompt's full
/// blocks for each of them); greedy, the `n` choices (`index` 0..n) are each the dense
/// reference, whole and streamed, and the usage counts the prompt once and every
/// sequence's tokens; sampled with a `seed`, the answer is the same every time, its
/// sequences differ, and sequence i is `n: 1` with `seed + i`; `best_of` other than `n`
/// and `n` past `--max-pending` are a 400 naming the field.
#[test]
fn n_sequences_of_one_prompt_share_its_kv_blocks_and_are_sampled_each_on_its_own() {
    use lockstep_gpu::model::{InitOptions, Model, TextTokenizer, greedy_reference};
    const MAX_TOKENS: usize = 12;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-n-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let ends: Vec<u32> = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    // One rank: every sequence runs where the first registered the prompt's blocks.
    let scenario = dir.join("one-rank.toml");
    std::fs::write(
        &scenario,
        r#"name = "one-rank-tiny"

[[server]]
name = "agg0"
role = "agg"
tensor_parallel_size = 1
max_batch_size = 8
max_num_tokens = 512
enable_chunked_prefill = true

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 16384
enable_block_reuse = true

[workload]
kind = "open_loop"
rate = 50.0
num_requests = 4
input_len = [64, 128]
output_len = [4, 8]
"#,
    )
    .expect("scenario");
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start(
        scenario.to_str().expect("utf-8"),
        &["--model", &dir_arg, "--max-pending", "4"],
    );
    let complete = |body: Value| -> Value {
        let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 200, "{answer}");
        json_of(&answer)
    };
    // 40 prompt tokens: two full blocks of 16 are reusable (the last token is always
    // computed). The first request with this prompt: any hit is the sequences sharing.
    let prompt: Vec<u32> = (0..40u32).map(|i| 3 + i * 7 % 50).collect();
    let v = complete(json!({"prompt": prompt, "max_tokens": 4, "n": 3, "temperature": 0}));
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(3), "{v}");
    let m = scrape_until(&s, |m| {
        over_ranks(m, "lockstep_prefix_cache_hit_blocks_total") >= 4.0
    });
    assert_eq!(
        over_ranks(&m, "lockstep_prefix_cache_hit_blocks_total"),
        4.0,
        "two blocks for each of the two sequences after the first: {m:?}"
    );
    // Greedy: each sequence is the dense reference.
    let text = "n sequences of one prompt";
    let ids = tokenizer.encode_prompt(text).expect("encode");
    let reference = greedy_reference(&model, &ids, MAX_TOKENS).expect("reference");
    let (shown, per_sequence) = match reference.iter().position(|t| ends.contains(t)) {
        Some(end) => (&reference[..end], end + 1),
        None => (&reference[..], MAX_TOKENS),
    };
    // The server holds back a byte-level piece of a character not yet whole.
    let want = tokenizer.decode(shown).expect("decode");
    let want = want.trim_end_matches('\u{FFFD}').to_string();
    let body =
        json!({"prompt": text, "max_tokens": MAX_TOKENS, "n": 3, "best_of": 3, "temperature": 0});
    let v = complete(body.clone());
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["text"], want.as_str(), "sequence {i}: {v}");
    }
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"], ids.len(), "the prompt once: {v}");
    assert_eq!(usage["completion_tokens"], 3 * per_sequence, "{v}");
    assert_eq!(usage["total_tokens"], ids.len() + 3 * per_sequence, "{v}");
    // Streamed: chunks of every index, each sequence's text the reference.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (code, events) = post(&s.url("/v1/completions"), &streamed.to_string(), None);
    assert_eq!(code, 200, "{events}");
    let events = sse_json(&events);
    let mut texts = vec![String::new(); 3];
    let mut finished = [0; 3];
    for e in &events {
        for c in e["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("an index") as usize;
            texts[i].push_str(c["text"].as_str().expect("text"));
            if !c["finish_reason"].is_null() {
                finished[i] += 1;
            }
        }
    }
    assert_eq!(texts, vec![want.clone(); 3], "{events:?}");
    assert_eq!(finished, [1; 3], "one finish per sequence: {events:?}");
    let usage = &events.last().expect("the usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 3 * per_sequence, "{events:?}");
    assert_eq!(usage["prompt_tokens"], ids.len(), "{events:?}");
    // Sampled with a seed: reproducible, not all alike, sequence i is seed + i.
    let sampled = |n: u32, seed: u64| -> Vec<String> {
        let v = complete(json!({"prompt": text, "max_tokens": MAX_TOKENS, "n": n,
            "temperature": 1, "seed": seed, "ignore_eos": true}));
        v["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().expect("text").to_string())
            .collect()
    };
    let a = sampled(3, 7);
    assert_eq!(a, sampled(3, 7), "the same seed, the same sequences");
    assert!(
        a[0] != a[1] || a[1] != a[2],
        "three identical samples: {a:?}"
    );
    assert_eq!(
        sampled(1, 8),
        [a[1].clone()],
        "sequence 1 samples with seed + 1"
    );
    // Chat: one choice per index.
    let (code, answer) = post(
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "n": 2, "temperature": 0})
        .to_string(),
        None,
    );
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    let c = v["choices"].as_array().expect("choices");
    assert_eq!(
        (c.len(), &c[0]["index"], &c[1]["index"]),
        (2, &json!(0), &json!(1))
    );
    assert_eq!(c[0]["message"], c[1]["message"], "greedy: alike");
    // Refused, naming the field: best_of past n, n past --max-pending 4, n of 0.
    for (extra, field, says) in [
        (json!({"n": 2, "best_of": 3}), "best_of", "3"),
        (json!({"n": 5}), "n", "--max-pending 4"),
        (json!({"n": 0}), "n", "0"),
    ] {
        let mut body = json!({"prompt": "x"});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        let (code, err) = post(&s.url("/v1/completions"), &body.to_string(), None);
        assert_eq!(code, 400, "{err}");
        let e = &json_of(&err)["error"];
        assert_eq!(e["param"], field, "{err}");
        assert!(e["message"].as_str().unwrap_or("").contains(says), "{err}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --model` with `stop_token_ids`: a greedy answer whose third token is given as
/// a stop id ends there, whole and streamed, on every one of `n` sequences
/// (`finish_reason: "stop"`, the token counted and not shown); an id outside the
/// vocabulary is a 400 naming the field and the id.
#[test]
fn a_stop_token_id_ends_the_answer_as_the_end_of_sequence_does() {
    use lockstep_gpu::model::{InitOptions, Model, TextTokenizer, greedy_reference};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-stop-ids-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let model = Model::load(&dir).expect("load");
    let tokenizer = TextTokenizer::load(&dir).expect("tokenizer");
    let ends: Vec<u32> = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    // A prompt whose greedy answer's third token is new and no end.
    let (text, reference) = (0..20)
        .map(|i| {
            let text = format!("stop token ids prompt {i}");
            let ids = tokenizer.encode_prompt(&text).expect("encode");
            (text, greedy_reference(&model, &ids, 8).expect("reference"))
        })
        .find(|(_, r)| !r[..3].iter().any(|t| ends.contains(t)) && !r[..2].contains(&r[2]))
        .expect("a prompt of three distinct first tokens");
    let want = tokenizer.decode(&reference[..2]).expect("decode");
    let dir_arg = dir.to_string_lossy().into_owned();
    let s = Server::start("model/agg-tiny.toml", &["--model", &dir_arg]);
    let body = json!({"prompt": text, "max_tokens": 8, "temperature": 0,
        "stop_token_ids": [reference[2]], "n": 2});
    let (code, answer) = post(&s.url("/v1/completions"), &body.to_string(), None);
    assert_eq!(code, 200, "{answer}");
    let v = json_of(&answer);
    for c in v["choices"].as_array().expect("choices") {
        assert_eq!(c["finish_reason"], "stop", "{v}");
        assert_eq!(c["text"], want.as_str(), "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 2 * 3, "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(1);
    let (code, events) = post(&s.url("/v1/completions"), &streamed.to_string(), None);
    assert_eq!(code, 200, "{events}");
    let events = sse_json(&events);
    let text: String = events
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(text, want);
    assert_eq!(
        events.last().expect("events")["choices"][0]["finish_reason"],
        "stop"
    );
    let vocab = model.config.vocab_size;
    let (code, err) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "x", "stop_token_ids": [1, vocab]}).to_string(),
        None,
    );
    assert_eq!(code, 400, "{err}");
    let e = &json_of(&err)["error"];
    assert_eq!(e["param"], "stop_token_ids", "{err}");
    assert!(
        e["message"]
            .as_str()
            .unwrap_or("")
            .contains(&vocab.to_string()),
        "{err}"
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that leaves an `n` = 3 answer, streamed or whole, cancels all three
/// sequences, and their KV is freed.
#[test]
fn a_client_that_disconnects_cancels_every_one_of_its_n_sequences() {
    // Paced by the model: 2,000 tokens take far longer than the test.
    let s = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    for (stream, cancelled) in [(true, 3.0), (false, 6.0)] {
        let body = json!({"prompt": "a b c d e f g h i j k l m n o p", "max_tokens": 2000,
            "n": 3, "stream": stream});
        let c = start_request(&s, &body, stream);
        let running = scrape_until(&s, |m| sample(m, "lockstep_num_requests_running") == 3.0);
        assert_eq!(
            sample(&running, "lockstep_num_requests_running"),
            3.0,
            "stream {stream}: the three sequences run: {running:?}"
        );
        drop(c);
        let after = scrape_until(&s, |m| {
            sample(m, "lockstep_request_cancelled_total") == cancelled
                && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
        });
        assert_eq!(
            sample(&after, "lockstep_request_cancelled_total"),
            cancelled,
            "stream {stream}: {after:?}"
        );
        assert_eq!(over_ranks(&after, "lockstep_kv_cache_used_blocks"), 0.0);
        assert_eq!(sample(&after, "lockstep_num_requests_running"), 0.0);
    }
}

/// With `--model` and `--max-model-len` both, the smaller bounds a request (prompt plus
/// `max_tokens`) and is what `/v1/models` shows; the refusal names whichever binds:
/// `--max-model-len` below the model's 4,096 positions, `max_position_embeddings` above.
#[test]
fn the_smaller_of_the_models_positions_and_max_model_len_bounds_a_request() {
    use lockstep_gpu::model::InitOptions;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-serve-context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lockstep_gpu::model::write_random_model(&dir, &InitOptions::default()).expect("init");
    let dir_arg = dir.to_string_lossy().into_owned();
    // (flag, the context, what sets it, whether to run a request exactly at it: only
    // the short one, as the other would generate thousands of tokens)
    for (flag, limit, named, run_at_limit) in [
        ("100", 100, "--max-model-len", true),
        ("10000", 4096, "max_position_embeddings", false),
    ] {
        let s = Server::start(
            "model/agg-tiny.toml",
            &["--model", &dir_arg, "--max-model-len", flag],
        );
        let (code, body) = get(&s.url("/v1/models"));
        assert_eq!(code, 200, "{body}");
        assert_eq!(json_of(&body)["data"][0]["max_model_len"], limit, "{body}");
        let (code, body) = post(
            &s.url("/v1/completions"),
            &json!({"prompt": [1, 2, 3], "max_tokens": limit}).to_string(),
            None,
        );
        assert_eq!(code, 400, "--max-model-len {flag}: {body}");
        let e = &json_of(&body)["error"];
        assert_eq!(e["param"], "max_tokens", "{body}");
        assert_eq!(e["code"], "context_length_exceeded", "{body}");
        let message = e["message"].as_str().expect("a message");
        assert!(
            message.contains(named) && message.contains(&limit.to_string()),
            "--max-model-len {flag}: {message}"
        );
        if run_at_limit {
            // Exactly at the limit: answered, to the last token.
            let (code, body) = post(
                &s.url("/v1/completions"),
                &json!({"prompt": [1, 2, 3], "max_tokens": limit - 3, "ignore_eos": true})
                    .to_string(),
                None,
            );
            assert_eq!(code, 200, "--max-model-len {flag}: {body}");
            assert_eq!(
                json_of(&body)["usage"]["completion_tokens"],
                limit - 3,
                "{body}"
            );
        }
        drop(s);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
