//! `lockstep bench` end to end: the binary against `lockstep serve` (zero-cost backend,
//! a free loopback port), against a port nothing listens on, and against a small fake
//! server whose answers the test chooses. Every child process has a deadline.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use lockstep_plan::report::Report;

use common::{example, output_within, simulate_with, temp};

/// Longest a child may take (hang protection, not a speed check).
const DEADLINE: Duration = Duration::from_secs(120);

fn example_path(name: &str) -> String {
    format!("{}/../../examples/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A running `lockstep serve`, killed on drop.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(scenario: &str, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["serve", &example_path(scenario), "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting lockstep serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(DEADLINE)
            .expect("lockstep serve announced no address");
        let addr = line
            .split("http://")
            .nth(1)
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        Server {
            child,
            url: format!("http://{addr}"),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `lockstep bench` with `args`, to its end (killed past the deadline).
fn bench(args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    c.arg("bench").args(args);
    output_within(c, DEADLINE)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn read_report(path: &std::path::Path) -> Report {
    let t = std::fs::read_to_string(path).expect("bench wrote its JSON");
    serde_json::from_str(&t).expect("the JSON is a lockstep report")
}

/// The closed loop of this test: 50 requests of ranged lengths, 8 at a time.
const CLOSED: [&str; 4] = [
    "workload.num_requests=50",
    "workload.concurrency=8",
    "workload.output_len=[4, 24]",
    "workload.input_len=[16, 200]",
];

#[test]
fn closed_loop_completes_every_request_with_the_asked_lengths_and_renders() {
    let server = Server::start("agg-balanced.toml", &[]);
    let json = temp("bench-closed.json");
    let mut args = vec![
        "--url",
        &server.url,
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
        "--slo",
        "e2e_ms=60000",
    ];
    for s in CLOSED {
        args.extend(["--set", s]);
    }
    let scenario = example_path("agg-dp2-binding.toml");
    args.push(&scenario);
    let out = bench(&args);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("Serving Benchmark Result"), "{stdout}");
    // The server models no time (no --time-scale), and bench says what that means.
    assert!(
        text(&out.stderr).contains("note: the server models no time"),
        "{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("Request goodput (req/s):"), "{stdout}");
    let report = read_report(&json);
    assert_eq!(report.requests.submitted, 50);
    assert_eq!(report.requests.completed, 50, "{:?}", report.per_request);
    assert_eq!(report.requests.failed, 0);
    assert_eq!(report.goodput.map(|g| g.good_requests), Some(50));
    // The lengths the workload asked for: the simulator plays the same closed loop
    // (same seed, ids issued in the same order) and generates exactly what it asks.
    let asked = simulate_with(&example("agg-dp2-binding.toml", &CLOSED), |o| {
        o.seed = 0;
        o.preload = false;
    });
    assert_eq!(asked.per_request.len(), 50);
    let lengths = |r: &Report| -> Vec<(u64, u32, u32)> {
        r.per_request
            .iter()
            .map(|d| (d.id, d.prompt_tokens, d.output_tokens))
            .collect()
    };
    assert_eq!(lengths(&report), lengths(&asked));
    assert!(report.latency_ms.ttft.samples == 50 && report.latency_ms.itl.samples > 0);
    assert!(
        report
            .per_request
            .iter()
            .all(|d| d.first_token_ms().is_some())
    );
    // `lockstep report` renders the page from a report without server sections.
    let page = temp("bench-closed.html");
    let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    c.arg("report").arg(&json).arg("-o").arg(&page);
    let out = output_within(c, DEADLINE);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(html.contains("<svg"), "the page has plots");
}

#[test]
fn conversation_rounds_all_complete_over_chat() {
    let server = Server::start("agg-conversation.toml", &[]);
    let json = temp("bench-conv.json");
    let scenario = example_path("agg-conversation.toml");
    let out = bench(&[
        "--url",
        &server.url,
        "--endpoint",
        "chat",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
        "--set",
        "workload.num_requests=40",
        "--set",
        "workload.concurrency=6",
        "--set",
        "workload.think_time_ms=5",
        "--set",
        "workload.input_len=[16, 64]",
        "--set",
        "workload.output_len=[2, 8]",
        "--set",
        "workload.conversation.new_tokens_per_round=[4, 16]",
        &scenario,
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let report = read_report(&json);
    assert_eq!(report.requests.submitted, 40);
    assert_eq!(report.requests.completed, 40, "{:?}", report.per_request);
    // Later rounds carry the earlier rounds' prompt and output: some prompts grew past
    // the first round's longest.
    assert!(report.per_request.iter().any(|d| d.prompt_tokens > 64));
    assert!(
        report
            .per_request
            .iter()
            .all(|d| (2..=8).contains(&d.output_tokens))
    );
}

#[test]
fn an_unreachable_url_fails_clearly_naming_it() {
    // A port nothing listens on: bound, then released.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let out = bench(&[
        "--url",
        &url,
        "--no-progress",
        &example_path("agg-dp2-binding.toml"),
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("--url {url}")) && stderr.contains("cannot reach the server"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = bench(&[
        "--url",
        "localhost:8000",
        &example_path("agg-dp2-binding.toml"),
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--url `localhost:8000`"), "{stderr}");
}

#[test]
fn a_server_answering_errors_fails_every_request_with_the_reason() {
    let server = Server::start("agg-balanced.toml", &["--api-key", "right"]);
    let json = temp("bench-401.json");
    let scenario = example_path("agg-dp2-binding.toml");
    let out = bench(&[
        "--url",
        &server.url,
        "--api-key",
        "wrong",
        "--model",
        "agg-balanced",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
        "--set",
        "workload.num_requests=12",
        "--set",
        "workload.concurrency=4",
        &scenario,
    ]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(text(&out.stderr).contains("12 of 12 requests failed"));
    assert!(
        stdout.contains("12 × HTTP 401: missing or wrong API key"),
        "{stdout}"
    );
    let report = read_report(&json);
    assert_eq!(
        (report.requests.submitted, report.requests.failed),
        (12, 12)
    );
    for d in &report.per_request {
        let why = d.failure().unwrap_or("");
        assert!(
            why.starts_with("HTTP 401: missing or wrong API key"),
            "{why}"
        );
    }
}

/// A fake OpenAI server on a free port: `/v1/models` names `fake`; the n-th completion
/// (from 1, the `--ignore-eos auto` probe included) with body `b` gets `answer(n, b)` as
/// a complete HTTP response. One request per connection.
fn fake_server(answer: fn(u32, &str) -> String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut n = 0;
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if conn.read(&mut byte).unwrap_or(0) == 0 {
                    break;
                }
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap_or(0));
            let mut body = vec![0u8; len];
            let _ = conn.read_exact(&mut body);
            let reply = if head.starts_with("get /v1/models") {
                let b = r#"{"object":"list","data":[{"id":"fake","object":"model"}]}"#;
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
                    b.len()
                )
            } else {
                n += 1;
                answer(n, &String::from_utf8_lossy(&body))
            };
            let _ = conn.write_all(reply.as_bytes());
        }
    });
    url
}

fn sse_response(events: &[&str]) -> String {
    let body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn the_usage_count_wins_and_a_stream_without_done_fails() {
    // Requests 1 and 2: three chunks of text, then a usage of 5 tokens and [DONE].
    // Requests 3 and 4: two chunks, and the stream ends without [DONE].
    let url = fake_server(|n, _| {
        let text = r#"{"choices":[{"index":0,"text":" w","finish_reason":null}]}"#;
        if n <= 2 {
            sse_response(&[
                text,
                text,
                text,
                r#"{"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":5}}"#,
                "[DONE]",
            ])
        } else {
            sse_response(&[text, text])
        }
    });
    let json = temp("bench-fake.json");
    let out = bench(&[
        "--url",
        &url,
        "--no-progress",
        // No probe: the fake counts only the workload's requests.
        "--ignore-eos",
        "on",
        "--json",
        json.to_str().unwrap(),
        "--set",
        "workload.num_requests=4",
        "--set",
        "workload.concurrency=1",
        "--set",
        "workload.input_len=16",
        "--set",
        "workload.output_len=5",
        &example_path("agg-dp2-binding.toml"),
    ]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "two requests failed: the run is incomplete, as sim and run say"
    );
    let report = read_report(&json);
    let got: Vec<(u64, u32, Option<String>)> = report
        .per_request
        .iter()
        .map(|d| (d.id, d.output_tokens, d.failure().map(String::from)))
        .collect();
    let cut = Some("the stream ended without [DONE] after 2 chunks".to_string());
    assert_eq!(
        got,
        [(1, 5, None), (2, 5, None), (3, 2, cut.clone()), (4, 2, cut)]
    );
    // Two inter-token samples per completed request (three chunks of text each).
    assert_eq!(report.latency_ms.itl.samples, 4);
}

/// A streamed answer of two tokens with its usage.
fn two_tokens() -> String {
    let text = r#"{"choices":[{"index":0,"text":" w","finish_reason":null}]}"#;
    sse_response(&[
        text,
        text,
        r#"{"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":2}}"#,
        "[DONE]",
    ])
}

/// An OpenAI-style 400 naming `field`.
fn refused(field: &str) -> String {
    let b = format!(
        r#"{{"error":{{"message":"Unrecognized request argument supplied: {field}","type":"invalid_request_error","param":null,"code":null}}}}"#
    );
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
        b.len()
    )
}

/// `bench` of four requests of two output tokens against `url`, with `extra`; its
/// output and report.
fn bench_four(url: &str, name: &str, extra: &[&str]) -> (Output, Report) {
    let json = temp(name);
    let _ = std::fs::remove_file(&json);
    let mut args = vec![
        "--url",
        url,
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend(extra);
    for s in [
        "workload.num_requests=4",
        "workload.concurrency=2",
        "workload.input_len=16",
        "workload.output_len=2",
    ] {
        args.extend(["--set", s]);
    }
    let scenario = example_path("agg-dp2-binding.toml");
    args.push(&scenario);
    let out = bench(&args);
    let report = read_report(&json);
    (out, report)
}

#[test]
fn ignore_eos_auto_leaves_it_out_only_where_the_server_refuses_it() {
    // As OpenAI's API: a 400 naming the vLLM extension.
    let refusing = fake_server(|_, body| {
        if body.contains("ignore_eos") || body.contains("min_tokens") {
            refused("ignore_eos")
        } else {
            two_tokens()
        }
    });
    let (out, report) = bench_four(&refusing, "bench-eos-auto.json", &[]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(report.requests.completed, 4, "{:?}", report.per_request);
    assert!(
        stderr.contains("note: the server refused vLLM's ignore_eos")
            && stderr.contains("HTTP 400: Unrecognized request argument supplied: ignore_eos"),
        "{stderr}"
    );
    // `off` sends neither field and says nothing.
    let (out, report) = bench_four(&refusing, "bench-eos-off.json", &["--ignore-eos", "off"]);
    assert!(out.status.success() && !text(&out.stderr).contains("note:"));
    assert_eq!(report.requests.completed, 4);
    // `on` sends them anyway: every request fails with the server's reason.
    let (out, report) = bench_four(&refusing, "bench-eos-on.json", &["--ignore-eos", "on"]);
    assert!(!out.status.success());
    assert_eq!(report.requests.failed, 4);
    assert!(report.per_request.iter().all(|d| {
        d.failure() == Some("HTTP 400: Unrecognized request argument supplied: ignore_eos")
    }));
    // A server that takes them (here: one that needs them) gets them under auto.
    let taking = fake_server(|_, body| {
        if body.contains(r#""ignore_eos":true"#) && body.contains("min_tokens") {
            two_tokens()
        } else {
            refused("wanted ignore_eos and min_tokens")
        }
    });
    let (out, report) = bench_four(&taking, "bench-eos-taken.json", &[]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(report.requests.completed, 4, "{:?}", report.per_request);
    assert!(!stderr.contains("note:"), "{stderr}");
}

/// Against `lockstep serve --model` with the tiny random model (a vocabulary of 512, the
/// CPU backend): asked nothing, bench draws ids from the tokenizer of the directory the
/// server names (`root`) and every request completes; an explicit range (1000..=30000)
/// lies outside it and every request fails with the server's reason; `--tokenizer`
/// draws them inside; a `--prompt-ids` range past the vocabulary is an error naming both
/// numbers before any request (the URL is never reached).
#[test]
fn prompt_ids_come_from_the_tokenizer_and_a_range_must_fit_it() {
    use lockstep_gpu::model::{InitOptions, write_random_model};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-bench-vocab-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_random_model(&dir, &InitOptions::default()).expect("init");
    let dir_arg = dir.to_string_lossy().into_owned();
    let server = Server::start("model/agg-tiny.toml", &["--model", &dir_arg]);
    let (out, report) = bench_four(&server.url, "bench-vocab-default.json", &[]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(report.requests.completed, 4, "{:?}", report.per_request);
    assert!(
        stderr.contains("note: prompt ids drawn from the served model's tokenizer")
            && stderr.contains(&dir_arg),
        "{stderr}"
    );
    let (out, report) = bench_four(
        &server.url,
        "bench-vocab-range.json",
        &["--prompt-ids", "1000-30000"],
    );
    assert!(!out.status.success());
    assert_eq!(report.requests.failed, 4, "{:?}", report.per_request);
    for d in &report.per_request {
        let why = d.failure().unwrap_or("");
        assert!(
            why.starts_with("HTTP 400") && why.contains("outside the model's vocabulary of 512"),
            "{why}"
        );
    }
    let (out, report) = bench_four(
        &server.url,
        "bench-vocab-tokenizer.json",
        &["--tokenizer", &dir_arg],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(report.requests.completed, 4, "{:?}", report.per_request);
    assert!(report.per_request.iter().all(|d| d.output_tokens == 2));
    drop(server);
    // The range checked before anything is sent: nothing listens at this URL.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    for (range, extra) in [("1000-30000", None), ("100-512", Some("0..=511"))] {
        let out = bench(&[
            "--url",
            &url,
            "--no-progress",
            "--tokenizer",
            &dir_arg,
            "--prompt-ids",
            range,
            &example_path("agg-dp2-binding.toml"),
        ]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains(&format!("--prompt-ids {range} does not fit the vocabulary"))
                && stderr.contains("512 ids")
                && extra.is_none_or(|e| stderr.contains(e)),
            "{stderr}"
        );
        assert!(!stderr.contains("cannot reach"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 32 item 4: `vllm bench serve`'s flags, no scenario file. 20 random prompts
/// sent at once, at most 4 in flight, and vLLM's result JSON beside ours.
#[test]
fn a_vllm_random_dataset_runs_without_a_scenario_and_saves_vllms_json() {
    let server = Server::start("agg-balanced.toml", &["--served-model-name", "m"]);
    let dir = temp("bench-vllm-result");
    let _ = std::fs::remove_dir_all(&dir);
    let out = bench(&[
        "--url",
        &server.url,
        "--no-progress",
        "--model",
        "org/some-path",
        "--served-model-name",
        "m",
        "--dataset-name",
        "random",
        "--num-prompts",
        "20",
        "--random-input-len",
        "32",
        "--random-output-len",
        "6",
        "--request-rate",
        "inf",
        "--max-concurrency",
        "4",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        dir.to_str().unwrap(),
        "--result-filename",
        "r.json",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("P90 E2EL (ms):"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).expect("saved"))
            .expect("JSON");
    for k in [
        "date",
        "backend",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "p90_tpot_ms",
        "p50_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
    ] {
        assert!(v.get(k).is_some(), "no `{k}` in {v}");
    }
    assert_eq!(v["completed"], 20, "{v}");
    assert_eq!(v["num_prompts"], 20);
    assert_eq!(v["request_rate"], "inf");
    assert_eq!(v["max_concurrency"], 4);
    assert_eq!(v["model_id"], "m");
    assert_eq!(v["tokenizer_id"], "org/some-path");
    assert_eq!(v["total_input_tokens"], 20 * 32);
    assert_eq!(v["total_output_tokens"], 20 * 6);
    let itls = v["itls"].as_array().unwrap();
    assert_eq!(itls.len(), 20);
    assert!(itls.iter().all(|l| l.as_array().unwrap().len() == 5), "{v}");
    assert!(
        v["ttfts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.as_f64().unwrap() > 0.0)
    );
}

/// ShareGPT's first turns give the lengths; a Poisson-like rate with burstiness paces
/// them; the dataset replaces a given scenario's `[workload]`.
#[test]
fn a_sharegpt_file_gives_the_lengths_and_replaces_the_scenarios_workload() {
    let server = Server::start("agg-balanced.toml", &[]);
    let data = temp("bench-sharegpt.json");
    std::fs::write(
        &data,
        r#"[{"id":"a","conversations":[{"from":"human","value":"one two three four five"},{"from":"gpt","value":"a b c d e f g"}]},
            {"id":"b","conversations":[{"from":"human","value":"w w w w w w w w"},{"from":"gpt","value":"x y z x y"}]},
            {"id":"c","conversations":[{"from":"human","value":"hi"}]}]"#,
    )
    .unwrap();
    let dir = temp("bench-sharegpt-result");
    let _ = std::fs::remove_dir_all(&dir);
    let scenario = example_path("agg-balanced.toml");
    let out = bench(&[
        "--url",
        &server.url,
        "--no-progress",
        &scenario,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        data.to_str().unwrap(),
        "--num-prompts",
        "2",
        "--request-rate",
        "50",
        "--burstiness",
        "0.5",
        "--save-result",
        "--result-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("vllm-50.0qps-agg-balanced-"), "{name}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(v["completed"], 2, "{v}");
    assert_eq!(v["request_rate"], 50.0);
    assert_eq!(v["burstiness"], 0.5);
    let mut pairs: Vec<(u64, u64)> = (0..2)
        .map(|i| {
            (
                v["input_lens"][i].as_u64().unwrap(),
                v["output_lens"][i].as_u64().unwrap(),
            )
        })
        .collect();
    pairs.sort_unstable();
    assert_eq!(pairs, vec![(5, 7), (8, 5)], "{v}");
    // --sharegpt-output-len fixes every output.
    let out = bench(&[
        "--url",
        &server.url,
        "--no-progress",
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        data.to_str().unwrap(),
        "--num-prompts",
        "2",
        "--sharegpt-output-len",
        "3",
        "--save-result",
        "--result-dir",
        dir.to_str().unwrap(),
        "--result-filename",
        "fixed.json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("fixed.json")).unwrap()).unwrap();
    assert_eq!(v["output_lens"], serde_json::json!([3, 3]), "{v}");
}

#[test]
fn bad_vllm_bench_flags_are_refused_naming_the_flag() {
    let url = "http://127.0.0.1:9";
    let scenario = example_path("agg-balanced.toml");
    for (args, says) in [
        (
            vec!["--dataset-name", "random", "--request-rate", "-1"],
            "--request-rate",
        ),
        (
            vec!["--dataset-name", "random", "--request-rate", "0"],
            "--request-rate",
        ),
        (vec!["--dataset-name", "foo"], "--dataset-name"),
        (
            vec!["--dataset-name", "random", "--burstiness", "0"],
            "--burstiness",
        ),
        (
            vec!["--dataset-name", "random", "--num-prompts", "0"],
            "--num-prompts",
        ),
        (
            vec!["--dataset-name", "random", "--random-range-ratio", "1.5"],
            "--random-range-ratio",
        ),
        (vec!["--dataset-name", "sharegpt"], "--dataset-path"),
        (
            vec![scenario.as_str(), "--num-prompts", "5"],
            "--num-prompts shapes",
        ),
        (vec![], "--dataset-name random|sharegpt"),
        (
            vec![
                "--dataset-name",
                "random",
                "--percentile-metrics",
                "ttft,foo",
            ],
            "--percentile-metrics",
        ),
        (
            vec!["--dataset-name", "random", "--metric-percentiles", "101"],
            "--metric-percentiles",
        ),
    ] {
        let mut all = vec!["--url", url, "--no-progress"];
        all.extend(args.iter().copied());
        let out = bench(&all);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The most requests in flight at once, by the client's send and end times.
fn peak_in_flight(report: &Report) -> i32 {
    let mut events: Vec<(f64, i32)> = report
        .per_request
        .iter()
        .flat_map(|d| [(d.arrival_ms(), 1), (d.end_ms().expect("ended"), -1)])
        .collect();
    // An end at the same instant as a send frees its place first.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut now = 0;
    events
        .iter()
        .map(|&(_, d)| {
            now += d;
            now
        })
        .max()
        .unwrap_or(0)
}

/// `--max-concurrency 2`, as vLLM's semaphore: 12 requests all due at once, never more
/// than two in flight (without it all twelve overlap on a server that takes time).
#[test]
fn max_concurrency_caps_the_requests_in_flight() {
    let server = Server::start("agg-balanced.toml", &["--time-scale", "1"]);
    let json = temp("bench-max-concurrency.json");
    let out = bench(&[
        "--url",
        &server.url,
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
        "--dataset-name",
        "random",
        "--num-prompts",
        "12",
        "--random-input-len",
        "64",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("models no time"),
        "a server pacing its cost model models time: {}",
        text(&out.stderr)
    );
    let report = read_report(&json);
    assert_eq!(report.requests.completed, 12, "{:?}", report.per_request);
    let peak = peak_in_flight(&report);
    assert!((1..=2).contains(&peak), "{peak} in flight at once");
}

/// `--request-rate 20` with `--burstiness 50` (gaps of 50 ms ± 14 %) spreads six sends
/// over about 250 ms; `inf` sends them all at once.
#[test]
fn request_rate_spaces_the_sends_and_inf_sends_all_at_once() {
    let server = Server::start("agg-balanced.toml", &[]);
    let spread = |rate: &str, name: &str| {
        let json = temp(name);
        let out = bench(&[
            "--url",
            &server.url,
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
            "--dataset-name",
            "random",
            "--num-prompts",
            "6",
            "--random-input-len",
            "16",
            "--random-output-len",
            "2",
            "--request-rate",
            rate,
            "--burstiness",
            "50",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let report = read_report(&json);
        assert_eq!(report.requests.completed, 6);
        let sends: Vec<f64> = report.per_request.iter().map(|d| d.arrival_ms()).collect();
        let first = sends.iter().copied().fold(f64::INFINITY, f64::min);
        let last = sends.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        last - first
    };
    let paced = spread("20", "bench-rate-20.json");
    assert!((180.0..600.0).contains(&paced), "sends over {paced} ms");
    let at_once = spread("inf", "bench-rate-inf.json");
    assert!(at_once < 100.0, "sends over {at_once} ms");
}

/// `bench --model` is the name sent in requests (as vLLM's); a model directory there
/// is refused with what to give instead.
#[test]
fn bench_model_refuses_a_model_directory() {
    let dir = temp("bench-model-dir");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let out = bench(&[
        "--url",
        "http://127.0.0.1:9",
        "--no-progress",
        "--dataset-name",
        "random",
        "--model",
        dir.to_str().unwrap(),
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("is a model directory"), "{err}");
    assert!(err.contains("--served-model-name"), "{err}");
    assert!(
        err.contains(&format!("--tokenizer {}", dir.display())),
        "{err}"
    );
}

/// Without a dataset, the saved `request_rate` is the scenario's open-loop rate (not
/// vLLM's `inf`, which would misdescribe a paced run).
#[test]
fn the_saved_rate_of_a_scenario_workload_is_its_open_loop_rate() {
    let server = Server::start("agg-balanced.toml", &[]);
    let dir = temp("bench-scenario-rate");
    let _ = std::fs::remove_dir_all(&dir);
    let scenario = example_path("agg-balanced.toml");
    let out = bench(&[
        "--url",
        &server.url,
        "--no-progress",
        &scenario,
        "--set",
        "workload.num_requests=4",
        "--set",
        "workload.rate=40",
        "--save-result",
        "--result-dir",
        dir.to_str().unwrap(),
        "--result-filename",
        "s.json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("s.json")).unwrap()).unwrap();
    assert_eq!(v["request_rate"], 40.0, "{v}");
    assert_eq!(v["completed"], 4, "{v}");
}
