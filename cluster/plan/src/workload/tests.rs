use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

const TPB: u32 = 16;

fn cfg(text: &str) -> WorkloadConfig {
    toml::from_str(text).unwrap_or_else(|e| panic!("config {text:?}: {e}"))
}

fn build(text: &str) -> Workload {
    Workload::new(&cfg(text), TPB, 7, Path::new(".")).expect("valid workload")
}

fn err_of(text: &str) -> String {
    match Workload::new(&cfg(text), TPB, 7, Path::new(".")) {
        Ok(_) => panic!("expected an error for {text:?}"),
        Err(e) => e.to_string(),
    }
}

/// Writes `contents` to a fresh file in the temp folder; tests run in parallel.
fn temp_file(name: &str, contents: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "lockstep-workload-{}-{n}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, contents).expect("write temp trace");
    path
}

fn trace_cfg(path: &Path, format: &str, extra: &str) -> String {
    format!(
        "kind = \"trace\"\n{extra}\n[trace]\npath = {:?}\nformat = \"{format}\"\n",
        path.display().to_string()
    )
}

fn load_trace(contents: &str, format: &str) -> Result<Workload, WorkloadError> {
    let path = temp_file(&format!("t.{format}"), contents);
    let r = Workload::new(&cfg(&trace_cfg(&path, format, "")), 64, 1, Path::new("."));
    std::fs::remove_file(&path).ok();
    r
}

fn trace_err(contents: &str, format: &str) -> String {
    match load_trace(contents, format) {
        Ok(_) => panic!("expected a parse error for {contents:?}"),
        Err(e) => {
            assert!(
                matches!(e, WorkloadError::TraceParse { .. }),
                "not a parse error: {e}"
            );
            e.to_string()
        }
    }
}

/// Pops every arrival regardless of time, for open-loop and trace workloads.
fn drain(w: &mut Workload) -> Vec<Arrival> {
    let mut out = Vec::new();
    while let Some(a) = w.pop_due(u64::MAX) {
        out.push(a);
    }
    out
}

#[test]
fn closed_loop_keeps_exactly_concurrency_outstanding_and_issues_num_requests() {
    let mut w = build("kind = \"closed_loop\"\nnum_requests = 50\nconcurrency = 4");
    assert_eq!(w.total(), Some(50));
    let mut outstanding: VecDeque<ReqId> = VecDeque::new();
    let (mut now, mut issued, mut finished) = (0u64, 0u64, 0u64);
    loop {
        while let Some(a) = w.pop_due(now) {
            assert_eq!(
                a.at_ns, now,
                "think time 0: the next request arrives at once"
            );
            issued += 1;
            assert_eq!(
                a.spec.id,
                ReqId(issued),
                "ids count up from 1 in issue order"
            );
            outstanding.push_back(a.spec.id);
        }
        assert_eq!(outstanding.len() as u64, 4.min(50 - finished));
        let Some(id) = outstanding.pop_front() else {
            break;
        };
        now += 1_000;
        w.on_finished(id, now, true);
        finished += 1;
    }
    assert_eq!(issued, 50);
    assert!(w.exhausted());
    assert_eq!(w.next_arrival_ns(), None);
}

#[test]
fn closed_loop_next_request_arrives_one_think_time_after_a_finish() {
    let mut w =
        build("kind = \"closed_loop\"\nnum_requests = 3\nconcurrency = 1\nthink_time_ms = 2.5");
    let a = w.pop_due(0).expect("first request at t=0");
    assert_eq!(w.next_arrival_ns(), None, "nothing until the response");
    w.on_finished(a.spec.id, 10_000, false);
    assert_eq!(w.next_arrival_ns(), Some(10_000 + 2_500_000));
    assert!(w.pop_due(2_509_999).is_none(), "not due yet");
    let b = w.pop_due(2_510_000).expect("due");
    assert_eq!((b.at_ns, b.spec.id), (2_510_000, ReqId(2)));
    w.on_finished(ReqId(99), 0, true); // unknown id: ignored
    w.on_finished(a.spec.id, 0, true); // reported twice: ignored
    assert_eq!(w.next_arrival_ns(), None);
    assert!(!w.exhausted());
}

#[test]
fn open_loop_mean_interarrival_is_within_ten_percent_of_one_over_rate() {
    let mut w = build("kind = \"open_loop\"\nnum_requests = 5000\nrate = 20.0");
    let arrivals = drain(&mut w);
    assert_eq!(arrivals.len(), 5000);
    assert!(w.exhausted());
    assert!(arrivals.windows(2).all(|p| p[0].at_ns <= p[1].at_ns));
    let mean_s = arrivals.last().unwrap().at_ns as f64 / 5000.0 / 1e9;
    assert!(
        (mean_s - 0.05).abs() < 0.005,
        "mean inter-arrival {mean_s} s, expected 0.05 s ± 10%"
    );
    // Finishes do not pull arrivals forward in an open loop.
    let mut w = build("kind = \"open_loop\"\nnum_requests = 3\nrate = 1.0");
    let first = w.pop_due(u64::MAX).unwrap();
    let next = w.next_arrival_ns();
    w.on_finished(first.spec.id, first.at_ns, true);
    assert_eq!(w.next_arrival_ns(), next);
}

const RANDOM: &str = "kind = \"open_loop\"\nnum_requests = 300\nrate = 50.0\n\
                      input_len = [100, 2000]\noutput_len = [1, 64]";

#[test]
fn same_seed_gives_identical_arrivals_and_a_different_seed_does_not() {
    let run = |seed: u64| {
        let mut w = Workload::new(&cfg(RANDOM), TPB, seed, Path::new(".")).unwrap();
        drain(&mut w)
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
    let ts = |a: &[Arrival]| a.iter().map(|a| a.at_ns).collect::<Vec<_>>();
    assert_ne!(
        ts(&run(1)),
        ts(&run(2)),
        "times differ too, not just lengths"
    );
    // `workload.seed` overrides the run's seed.
    let pinned = cfg(&format!("{RANDOM}\nseed = 5"));
    let a = drain(&mut Workload::new(&pinned, TPB, 1, Path::new(".")).unwrap());
    let b = drain(&mut Workload::new(&pinned, TPB, 2, Path::new(".")).unwrap());
    assert_eq!(a, b);
    assert_eq!(a, run(5));
}

#[test]
fn drawn_lengths_stay_inside_their_inclusive_ranges_and_cover_them() {
    let mut w = Workload::new(
        &cfg(&RANDOM.replace("num_requests = 300", "num_requests = 3000")),
        TPB,
        3,
        Path::new("."),
    )
    .unwrap();
    let arrivals = drain(&mut w);
    let prompts: Vec<u32> = arrivals.iter().map(|a| a.spec.prompt_len).collect();
    let outputs: Vec<u32> = arrivals.iter().map(|a| a.spec.max_new_tokens).collect();
    assert!(prompts.iter().all(|p| (100..=2000).contains(p)));
    assert!(outputs.iter().all(|o| (1..=64).contains(o)));
    assert_eq!(
        *outputs.iter().min().unwrap(),
        1,
        "inclusive lower bound is reached"
    );
    assert_eq!(
        *outputs.iter().max().unwrap(),
        64,
        "inclusive upper bound is reached"
    );
    assert!(*prompts.iter().min().unwrap() < 150 && *prompts.iter().max().unwrap() > 1950);
    for a in &arrivals {
        assert_eq!(a.spec.block_hashes.len() as u32, a.spec.prompt_len / TPB);
        assert_eq!(a.spec.conversation, None);
    }
}

#[test]
fn shared_prefix_blocks_are_identical_across_requests_and_the_rest_unique() {
    let mut w = build(
        "kind = \"open_loop\"\nnum_requests = 20\nrate = 10.0\ninput_len = 1000\n\
         shared_prefix_tokens = 200",
    );
    let arrivals = drain(&mut w);
    let shared = 200 / TPB as usize; // 12 full blocks; the partial 13th is not shared
    let first = &arrivals[0].spec.block_hashes;
    assert_eq!(first.len(), 1000 / TPB as usize);
    let mut seen = BTreeSet::new();
    for a in &arrivals {
        assert_eq!(a.spec.block_hashes[..shared], first[..shared]);
        for h in &a.spec.block_hashes[shared..] {
            assert!(seen.insert(*h), "unique block hash {h:#x} repeats");
        }
    }
    assert!(first[..shared].iter().all(|h| !seen.contains(h)));
}

#[test]
fn conversation_rounds_extend_the_previous_prompt_and_hashes_and_wait_for_it() {
    let mut w = build(
        "kind = \"closed_loop\"\nnum_requests = 5\nconcurrency = 1\nthink_time_ms = 5\n\
         input_len = 1000\noutput_len = 50\n\
         [conversation]\nrounds = 3\nnew_tokens_per_round = 100",
    );
    assert_eq!(w.total(), Some(5));
    let r1 = w.pop_due(0).expect("round 1 at t=0").spec;
    let conv = r1.conversation.expect("a conversation id");
    assert_eq!((r1.prompt_len, r1.block_hashes.len()), (1000, 62));
    assert_eq!(w.next_arrival_ns(), None, "round 2 waits for round 1");
    assert!(w.pop_due(u64::MAX).is_none());

    w.on_finished(r1.id, 1_000_000, true);
    assert_eq!(w.next_arrival_ns(), Some(6_000_000), "finish + think time");
    let r2 = w.pop_due(6_000_000).unwrap().spec;
    assert_eq!(r2.conversation, Some(conv));
    assert_eq!(r2.prompt_len, 1000 + 50 + 100);
    assert_eq!(r2.block_hashes.len(), 1150 / 16);
    assert_eq!(r2.block_hashes[..62], r1.block_hashes[..]);
    assert!(
        !r1.block_hashes.contains(&r2.block_hashes[62]),
        "the block that was partial in round 1 is new content"
    );

    // A failed round produced no output: the next prompt carries only the new tokens.
    w.on_finished(r2.id, 7_000_000, false);
    let r3 = w.pop_due(u64::MAX).unwrap().spec;
    assert_eq!((r3.conversation, r3.prompt_len), (Some(conv), 1150 + 100));
    assert_eq!(
        r3.block_hashes[..r2.block_hashes.len()],
        r2.block_hashes[..]
    );

    // Three rounds done: a new conversation starts; the last one is cut to 2 rounds.
    w.on_finished(r3.id, 8_000_000, true);
    let r4 = w.pop_due(u64::MAX).unwrap().spec;
    assert_ne!(r4.conversation, Some(conv));
    assert_eq!(r4.prompt_len, 1000);
    assert_ne!(
        r4.block_hashes[0], r1.block_hashes[0],
        "no shared prefix configured"
    );
    w.on_finished(r4.id, 9_000_000, true);
    let r5 = w.pop_due(u64::MAX).unwrap().spec;
    assert_eq!((r5.conversation, r5.id), (r4.conversation, ReqId(5)));
    assert!(w.exhausted());
    w.on_finished(r5.id, 10_000_000, true);
    assert_eq!(w.next_arrival_ns(), None);
}

#[test]
fn closed_loop_conversations_count_concurrency_in_conversations() {
    let mut w = build(
        "kind = \"closed_loop\"\nnum_requests = 40\nconcurrency = 3\n\
         [conversation]\nrounds = [1, 6]\nnew_tokens_per_round = [10, 20]",
    );
    let mut now = 0;
    let mut outstanding = VecDeque::new();
    let mut issued = 0;
    loop {
        while let Some(a) = w.pop_due(now) {
            issued += 1;
            outstanding.push_back(a.spec);
        }
        let convs: BTreeSet<_> = outstanding.iter().map(|s| s.conversation).collect();
        assert_eq!(
            convs.len(),
            outstanding.len(),
            "one round per conversation at a time"
        );
        assert!(outstanding.len() <= 3);
        let Some(s) = outstanding.pop_front() else {
            break;
        };
        now += 1;
        w.on_finished(s.id, now, true);
    }
    assert_eq!(issued, 40);
    assert!(w.exhausted());
}

#[test]
fn open_loop_conversations_issue_num_requests_rounds() {
    let mut w = build(
        "kind = \"open_loop\"\nnum_requests = 100\nrate = 5.0\nthink_time_ms = 1\n\
         [conversation]\nrounds = [2, 5]\nnew_tokens_per_round = 32",
    );
    let mut issued = Vec::new();
    while let Some(t) = w.next_arrival_ns() {
        let a = w.pop_due(t).unwrap();
        w.on_finished(a.spec.id, t + 1_000, true);
        issued.push(a);
    }
    assert_eq!(issued.len(), 100);
    assert!(w.exhausted());
    let ids: Vec<u64> = issued.iter().map(|a| a.spec.id.0).collect();
    assert_eq!(ids, (1..=100).collect::<Vec<_>>());
    assert!(issued.iter().all(|a| a.spec.conversation.is_some()));
}

#[test]
fn mooncake_lines_parse_and_each_trace_block_expands_into_kv_blocks() {
    // 1100 tokens: trace blocks of 512 → 3 ids; KV blocks of 64 → 17 full ones
    // (8 + 8 + 1), the partial 18th gets no hash.
    let text = "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 7, \"hash_ids\": [0, 1, 2]}\n\
                \n\
                {\"timestamp\": 3000, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n";
    let mut w = load_trace(text, "mooncake").expect("valid trace");
    assert_eq!(w.total(), Some(2));
    assert_eq!(w.next_arrival_ns(), Some(0));
    let a = w.pop_due(0).unwrap();
    assert!(w.pop_due(2_999_999_999).is_none());
    let b = w.pop_due(3_000_000_000).unwrap();
    assert!(w.exhausted());
    assert_eq!(
        (a.spec.id, a.spec.prompt_len, a.spec.max_new_tokens),
        (ReqId(1), 1100, 7)
    );
    assert_eq!(
        (b.at_ns, b.spec.id, b.spec.prompt_len),
        (3_000_000_000, ReqId(2), 512)
    );
    let h = &a.spec.block_hashes;
    assert_eq!(h.len(), 17);
    let golden = 0x9E37_79B9_7F4A_7C15u64;
    for (k, hash) in h.iter().enumerate() {
        let (id, sub) = ((k / 8) as u64, (k % 8) as u64);
        assert_eq!(*hash, mix(id.wrapping_mul(golden) ^ sub), "KV block {k}");
    }
    assert_eq!(
        b.spec.block_hashes[..],
        h[..8],
        "same trace block 0 → same prefix"
    );
    assert_eq!(b.spec.conversation, None);
}

#[test]
fn trace_time_scale_num_requests_cap_and_relative_path_apply() {
    let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [4]}\n\
                {\"timestamp\": 1000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}\n\
                {\"timestamp\": 2000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [6]}\n\
                not even json\n";
    let path = temp_file("scaled.jsonl", text);
    let name = path.file_name().unwrap().to_str().unwrap().to_string();
    let text = format!(
        "kind = \"trace\"\nnum_requests = 3\n[trace]\npath = {name:?}\nformat = \"mooncake\"\n\
         time_scale = 0.5"
    );
    let mut w =
        Workload::new(&cfg(&text), 64, 0, &std::env::temp_dir()).expect("cap skips bad line");
    std::fs::remove_file(&path).ok();
    assert_eq!(w.total(), Some(3));
    let times: Vec<u64> = drain(&mut w).iter().map(|a| a.at_ns).collect();
    assert_eq!(times, [0, 500_000_000, 1_000_000_000]);
}

#[test]
fn azure_rows_parse_with_crlf_and_no_trailing_newline() {
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n\
                2023-11-16 18:15:46.6805900,374,44\r\n\
                2023-11-16 18:15:46.6805900,10,2\r\n\
                2023-11-16 23:59:59.9999999,5,1\r\n\
                2023-11-17 00:00:01.5,197,183";
    let mut w = load_trace(text, "azure").expect("valid trace");
    assert_eq!(w.total(), Some(4));
    let a = drain(&mut w);
    let rows: Vec<(u64, u32, u32)> = a
        .iter()
        .map(|a| (a.at_ns, a.spec.prompt_len, a.spec.max_new_tokens))
        .collect();
    // 18:15:46.6805900 to midnight is 5 h 44 min 13.3194100 s.
    let to_midnight = (5 * 3600 + 44 * 60 + 13) * 1_000_000_000 + 319_410_000;
    assert_eq!(
        rows,
        [
            (0, 374, 44),
            (0, 10, 2),
            (to_midnight - 100, 5, 1),
            (to_midnight + 1_500_000_000, 197, 183),
        ],
        "relative to the first row, across the day rollover"
    );
    assert!(a.iter().all(|a| a.spec.block_hashes.is_empty()));
    assert_eq!(a[1].spec.id, ReqId(2), "ties keep file order");
}

#[test]
fn dates_convert_to_days_since_the_epoch() {
    assert_eq!(trace::days_from_civil(1970, 1, 1), 0);
    assert_eq!(trace::days_from_civil(2000, 3, 1), 11_017);
    assert_eq!(trace::days_from_civil(2023, 11, 16), 19_677);
    assert_eq!(
        trace::parse_datetime("2024-03-01 00:00:00").unwrap()
            - trace::parse_datetime("2024-02-28 23:59:59.25").unwrap(),
        86_400_750_000_000,
        "2024 is a leap year"
    );
    assert!(trace::parse_datetime("2023-02-29 00:00:00").is_err());
}

#[test]
fn mooncake_errors_name_the_line_and_field() {
    let good =
        "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n";
    let cases = [
        ("{\"timestamp\": 6, \"input_length\": 10,", "invalid JSON"),
        (
            "{\"timestamp\": 6, \"input_length\": 10, \"hash_ids\": [0]}",
            "missing field `output_length`",
        ),
        (
            "{\"timestamp\": 6, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [0]}",
            "`output_length` = 0",
        ),
        (
            "{\"timestamp\": 6, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
            "`input_length` = 0",
        ),
        (
            "{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}",
            "`timestamp` = 4 is before",
        ),
        (
            "{\"timestamp\": 6, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0], \"x\": 1}",
            "unknown field `x`",
        ),
        (
            "{\"timestamp\": 6, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [0]}",
            "`hash_ids` has 1 entries",
        ),
        (
            "{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}",
            "`timestamp` = -1",
        ),
    ];
    for (bad, want) in cases {
        let msg = trace_err(&format!("{good}\n{bad}\n"), "mooncake");
        assert!(msg.contains(":3: "), "line 3 in {msg:?}");
        assert!(msg.contains(want), "{want:?} in {msg:?}");
    }
    let msg = trace_err("", "mooncake");
    assert!(msg.contains("no records"), "{msg}");
}

#[test]
fn azure_errors_name_the_line_and_field() {
    let head = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n";
    let cases = [
        (
            "2023-11-16 18:15:4x.0,1,1",
            "`TIMESTAMP` = \"2023-11-16 18:15:4x.0\": second",
        ),
        ("2023-13-16 18:15:47.0,1,1", "month 13"),
        ("2023-11-16T18:15:47.0,1,1", "`TIMESTAMP`"),
        ("2023-11-16 18:15:47.0,0,1", "`ContextTokens` = \"0\""),
        ("2023-11-16 18:15:47.0,5,0", "`GeneratedTokens` = \"0\""),
        ("2023-11-16 18:15:47.0,five,1", "`ContextTokens` = \"five\""),
        ("2023-11-16 18:15:45.0,1,1", "is before the previous row"),
        ("2023-11-16 18:15:47.0,1", "2 fields"),
    ];
    for (bad, want) in cases {
        let msg = trace_err(&format!("{head}{bad}"), "azure");
        assert!(msg.contains(":3: "), "line 3 in {msg:?}");
        assert!(msg.contains(want), "{want:?} in {msg:?}");
    }
    let msg = trace_err("TIMESTAMP,Context,GeneratedTokens\r\n", "azure");
    assert!(
        msg.contains(":1: ") && msg.contains("`ContextTokens`"),
        "{msg}"
    );
}

#[test]
fn a_missing_trace_file_is_a_read_error_naming_the_path() {
    let text = trace_cfg(Path::new("/nonexistent/lockstep.jsonl"), "mooncake", "");
    let e = Workload::new(&cfg(&text), 16, 0, Path::new("."))
        .err()
        .unwrap();
    assert!(matches!(e, WorkloadError::TraceRead { .. }));
    assert!(e.to_string().contains("/nonexistent/lockstep.jsonl"), "{e}");
}

#[test]
fn config_errors_name_the_key_and_value() {
    let cases = [
        (
            "kind = \"closed_loop\"\nnum_requests = 5",
            "workload.concurrency",
            "required",
        ),
        (
            "kind = \"closed_loop\"\nnum_requests = 5\nconcurrency = 0",
            "workload.concurrency",
            "got 0",
        ),
        (
            "kind = \"closed_loop\"\nconcurrency = 2",
            "workload.num_requests",
            "required",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 0.0",
            "workload.rate",
            "got 0",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = -2.5",
            "workload.rate",
            "-2.5",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5",
            "workload.rate",
            "required",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 1.0\nconcurrency = 3",
            "workload.concurrency",
            "3",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 1.0\ninput_len = [300, 200]",
            "workload.input_len",
            "[300, 200]",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 1.0\noutput_len = [0, 20]",
            "workload.output_len",
            "[0, 20]",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 1.0\noutput_len = 0",
            "workload.output_len",
            "got 0",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 0\nrate = 1.0",
            "workload.num_requests",
            "got 0",
        ),
        (
            "kind = \"closed_loop\"\nnum_requests = 5\nconcurrency = 1\nthink_time_ms = -1",
            "workload.think_time_ms",
            "-1",
        ),
        (
            "kind = \"open_loop\"\nnum_requests = 5\nrate = 1.0\ninput_len = 100\n\
             shared_prefix_tokens = 128",
            "workload.shared_prefix_tokens",
            "128",
        ),
        (
            "kind = \"closed_loop\"\nnum_requests = 5\nconcurrency = 1\n\
             [conversation]\nrounds = [3, 2]\nnew_tokens_per_round = 5",
            "workload.conversation.rounds",
            "[3, 2]",
        ),
        ("kind = \"trace\"", "workload.trace", "required"),
        (
            "kind = \"trace\"\n[trace]\npath = \"x\"\nformat = \"azure\"\ntime_scale = 0.0",
            "workload.trace.time_scale",
            "got 0",
        ),
        (
            "kind = \"trace\"\n[trace]\npath = \"x\"\nformat = \"mooncake\"\nblock_tokens = 100",
            "workload.trace.block_tokens",
            "100",
        ),
        (
            "kind = \"trace\"\nrate = 4.0\n[trace]\npath = \"x\"\nformat = \"azure\"",
            "workload.rate",
            "4",
        ),
    ];
    for (text, field, value) in cases {
        let msg = err_of(text);
        assert!(msg.starts_with(&format!("{field}: ")), "{field} in {msg:?}");
        assert!(msg.contains(value), "{value:?} in {msg:?}");
    }
    assert!(
        toml::from_str::<WorkloadConfig>("kind = \"open_loop\"\nrte = 1.0").is_err(),
        "unknown keys are rejected"
    );
}

#[test]
fn config_lengths_parse_as_a_number_or_a_range_with_defaults() {
    let c = cfg("kind = \"closed_loop\"\nnum_requests = 1\nconcurrency = 1\ninput_len = [5, 9]");
    assert_eq!(c.input_len, LenSpec::Range([5, 9]));
    assert_eq!(c.output_len, LenSpec::Fixed(128));
    let c = cfg("kind = \"trace\"\n[trace]\npath = \"t.csv\"\nformat = \"azure\"");
    let t = c.trace.unwrap();
    assert_eq!((t.time_scale, t.block_tokens()), (1.0, 512));
    assert_eq!(c.input_len, LenSpec::Fixed(1024));
}

/// The published traces, kept in the repository under `data/traces/` (see its README).
const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/traces/mooncake_conversation.jsonl"
);
const AZURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/traces/azure_conv_2023.csv"
);

#[test]
fn the_bundled_traces_parse_with_the_documented_counts_and_spans() {
    let load = |path: &str, format: &str| {
        let c = cfg(&trace_cfg(Path::new(path), format, ""));
        let mut w = Workload::new(&c, 16, 0, Path::new(".")).expect("trace parses");
        let total = w.total();
        (total, drain(&mut w))
    };
    let (total, m) = load(MOONCAKE, "mooncake");
    assert_eq!((total, m.len()), (Some(12_031), 12_031));
    assert_eq!(m[0].at_ns, 0);
    assert_eq!(m.last().unwrap().at_ns, 3_536_999 * 1_000_000);
    assert_eq!(
        (m[0].spec.prompt_len, m[0].spec.max_new_tokens),
        (6758, 500)
    );
    assert_eq!(m[0].spec.block_hashes.len(), 6758 / 16);
    assert_eq!(
        m.last().unwrap().spec.block_hashes[..32],
        m[0].spec.block_hashes[..32],
        "block 0 is shared across the trace"
    );

    let (total, a) = load(AZURE, "azure");
    assert_eq!((total, a.len()), (Some(19_366), 19_366));
    assert_eq!(
        (a[0].at_ns, a[0].spec.prompt_len, a[0].spec.max_new_tokens),
        (0, 374, 44)
    );
    let last = a.last().unwrap();
    assert_eq!((last.spec.prompt_len, last.spec.max_new_tokens), (197, 183));
    // 18:15:46.6805900 → 19:14:08.4025270
    assert_eq!(last.at_ns, 3_501_721_937_000);
    assert!((last.at_ns as f64 / 1e9 - 3501.7).abs() < 0.1);
}

#[test]
fn a_trace_summary_counts_spans_and_ranges_the_records_read_unscaled() {
    let path = temp_file(
        "summary.jsonl",
        "{\"timestamp\": 1000, \"input_length\": 300, \"output_length\": 9, \"hash_ids\": [1]}\n\
         {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 40, \"hash_ids\": [2]}\n\
         {\"timestamp\": 5000, \"input_length\": 200, \"output_length\": 20, \"hash_ids\": [3]}\n\
         {\"timestamp\": 9000, \"input_length\": 900, \"output_length\": 1, \"hash_ids\": [4, 5]}\n",
    );
    let t = TraceConfig {
        time_scale: 0.25,
        ..cfg(&trace_cfg(&path, "mooncake", "")).trace.unwrap()
    };
    let all = summarize_trace(&t, Path::new("."), None).expect("summary");
    assert_eq!(
        all,
        TraceSummary {
            records: 4,
            span_s: 8.0,
            prompt_len: (100, 900),
            output_len: (1, 40),
        }
    );
    assert_eq!(all.arrival_rate(), Some(3.0 / 8.0));
    let first3 = summarize_trace(&t, Path::new("."), Some(3)).expect("summary");
    assert_eq!((first3.records, first3.span_s), (3, 4.0));
    assert_eq!(
        (first3.prompt_len, first3.output_len),
        ((100, 300), (9, 40))
    );
    let one = summarize_trace(&t, Path::new("."), Some(1)).expect("summary");
    assert_eq!(one.arrival_rate(), None, "one record has no rate");
    // Passing over the first record: the next two, from time 0.
    let skipped = TraceConfig {
        skip: 1,
        ..t.clone()
    };
    let next2 = summarize_trace(&skipped, Path::new("."), Some(2)).expect("summary");
    assert_eq!((next2.records, next2.span_s), (2, 2.0));
    assert_eq!((next2.prompt_len, next2.output_len), ((100, 200), (20, 40)));
    let c = cfg(&trace_cfg(&path, "mooncake", "num_requests = 2"));
    let mut w = Workload::new(
        &WorkloadConfig {
            trace: Some(TraceConfig {
                skip: 2,
                ..c.trace.clone().unwrap()
            }),
            ..c
        },
        TPB,
        0,
        Path::new("."),
    )
    .expect("valid");
    let arrivals = drain(&mut w);
    let shape: Vec<(u64, u32)> = arrivals
        .iter()
        .map(|a| (a.at_ns, a.spec.prompt_len))
        .collect();
    assert_eq!(shape, [(0, 200), (4_000_000_000, 900)]);
    let all = TraceConfig {
        skip: 4,
        ..t.clone()
    };
    let e = summarize_trace(&all, Path::new("."), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("workload.trace.skip") && e.contains("has 4"),
        "{e}"
    );
    std::fs::remove_file(&path).ok();
}

// ---- warm-up and ramp ----

/// Pops every arrival due by `now`.
fn due(w: &mut Workload, now: u64) -> Vec<Arrival> {
    std::iter::from_fn(|| w.pop_due(now)).collect()
}

#[test]
fn warm_up_requests_go_one_at_a_time_before_the_load() {
    let mut w =
        build("kind = \"closed_loop\"\nconcurrency = 4\nnum_requests = 8\nwarmup_requests = 2\n");
    assert_eq!(w.total(), Some(10));
    assert_eq!(w.warmup_requests(), 2);
    // Only the first warm-up is pending, whatever the time.
    let first = due(&mut w, u64::MAX / 2);
    assert_eq!(first.iter().map(|a| a.spec.id.0).collect::<Vec<_>>(), [1]);
    assert_eq!(w.load_start_ns(), None);
    w.on_finished(ReqId(1), 1_000, true);
    let second = due(&mut w, u64::MAX / 2);
    assert_eq!(second.iter().map(|a| a.spec.id.0).collect::<Vec<_>>(), [2]);
    assert_eq!(second[0].at_ns, 1_000);
    w.on_finished(ReqId(2), 5_000, true);
    // The load starts when the last warm-up ends: all four clients at once.
    assert_eq!(w.load_start_ns(), Some(5_000));
    let load = due(&mut w, 5_000);
    assert_eq!(
        load.iter()
            .map(|a| (a.spec.id.0, a.at_ns))
            .collect::<Vec<_>>(),
        [(3, 5_000), (4, 5_000), (5, 5_000), (6, 5_000)]
    );
    assert!(w.preload_blocker().unwrap().contains("warmup_requests"));
}

#[test]
fn a_ramp_spreads_closed_loop_clients_evenly() {
    let mut w =
        build("kind = \"closed_loop\"\nconcurrency = 4\nnum_requests = 8\nramp_s = 0.002\n");
    let starts: Vec<u64> = due(&mut w, u64::MAX / 2).iter().map(|a| a.at_ns).collect();
    assert_eq!(starts, [0, 500_000, 1_000_000, 1_500_000]);
}

#[test]
fn a_ramp_stretches_open_loop_arrivals_without_dropping_any() {
    let text = "kind = \"open_loop\"\nrate = 1000.0\nnum_requests = 400\n";
    let flat: Vec<u64> = due(&mut build(text), u64::MAX / 2)
        .iter()
        .map(|a| a.at_ns)
        .collect();
    let ramped: Vec<u64> = due(&mut build(&format!("{text}ramp_s = 0.1\n")), u64::MAX / 2)
        .iter()
        .map(|a| a.at_ns)
        .collect();
    assert_eq!(flat.len(), 400);
    assert_eq!(ramped.len(), 400);
    let r = 0.1e9;
    for (&u, &t) in flat.iter().zip(&ramped) {
        // t = sqrt(2 R u) while u < R/2, then u + R/2 (the same draws, warped).
        let want = if (u as f64) < r / 2.0 {
            (2.0 * r * u as f64).sqrt()
        } else {
            u as f64 + r / 2.0
        };
        assert!(
            (t as f64 - want).abs() <= 1.0,
            "u {u} -> t {t}, want {want}"
        );
    }
    // The rate rises linearly: the first half of the ramp holds a quarter of what the
    // ramp holds at full rate.
    let in_first_half = ramped.iter().filter(|&&t| (t as f64) < r / 2.0).count();
    assert!((5..=25).contains(&in_first_half), "{in_first_half}");
}

#[test]
fn a_bad_ramp_names_the_key() {
    let e = err_of("kind = \"closed_loop\"\nconcurrency = 1\nnum_requests = 1\nramp_s = -1.0\n");
    assert!(e.contains("workload.ramp_s") && e.contains("-1"), "{e}");
}

// ---- the trace parsers never panic ----

mod fuzz {
    use super::super::trace::{parse_azure, parse_mooncake};
    use proptest::prelude::*;

    /// Lines that look like the formats, mangled: the parsers meet real-looking garbage,
    /// not only random bytes.
    fn mooncake_line() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            (any::<i64>(), any::<i64>(), any::<i64>(), prop::collection::vec(any::<i64>(), 0..6)).prop_map(
                |(t, i, o, h)| format!(
                    r#"{{"timestamp": {t}, "input_length": {i}, "output_length": {o}, "hash_ids": {h:?}}}"#
                )
            ),
            (any::<f64>(), "[a-z_]{0,12}", any::<u32>()).prop_map(|(t, k, v)| format!(
                r#"{{"timestamp": {t}, "{k}": {v}, "input_length": 1e400}}"#
            )),
        ]
    }

    fn azure_line() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            ("[0-9: .-]{0,30}", any::<i64>(), any::<i64>())
                .prop_map(|(t, c, g)| format!("{t},{c},{g}")),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u8>(),
                any::<i64>(),
                any::<i64>()
            )
                .prop_map(|(d, h, m, c, g)| format!(
                    "2023-11-{d:02} {h:02}:{m:02}:00.0000000,{c},{g}"
                )),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn mooncake_input_is_parsed_or_refused_never_a_panic(
            lines in prop::collection::vec(mooncake_line(), 0..8),
            scale in prop_oneof![Just(1.0), Just(1e-300), Just(1e300), any::<f64>()],
            block in 1u32..2048,
        ) {
            let text = lines.join("\n");
            if let Ok(records) = parse_mooncake(&text, "fuzz.jsonl", scale, block, 1000) {
                // Accepted records are usable: positive lengths, ordered arrivals.
                for w in records.windows(2) {
                    prop_assert!(w[0].at_ns <= w[1].at_ns);
                }
                prop_assert!(records.iter().all(|r| r.prompt_len > 0 && r.output_len > 0));
            }
        }

        #[test]
        fn azure_input_is_parsed_or_refused_never_a_panic(
            lines in prop::collection::vec(azure_line(), 0..8),
            header in prop_oneof![
                Just("TIMESTAMP,ContextTokens,GeneratedTokens".to_string()),
                any::<String>()
            ],
        ) {
            let text = format!("{header}\n{}", lines.join("\r\n"));
            if let Ok(records) = parse_azure(&text, "fuzz.csv", 1.0, 1000) {
                prop_assert!(records.iter().all(|r| r.prompt_len > 0 && r.output_len > 0));
            }
        }
    }
}

/// `longest_request` bounds the positions any request takes (what `--model` checks at
/// startup), and a conversation whose rounds all complete reaches it in its last round.
#[test]
fn longest_request_is_the_last_round_of_a_conversation_at_its_longest() {
    let mut w = build(
        "kind = \"closed_loop\"\nnum_requests = 3\nconcurrency = 1\n\
         input_len = 1000\noutput_len = 50\n\
         [conversation]\nrounds = 3\nnew_tokens_per_round = 100",
    );
    assert_eq!(w.longest_request(), 1000 + 50 + 2 * (100 + 50));
    let mut seen = 0;
    for t in 0..3u64 {
        let r = w.pop_due(u64::MAX).expect("the next round").spec;
        seen = seen.max(u64::from(r.prompt_len) + u64::from(r.max_new_tokens));
        w.on_finished(r.id, t * 1_000_000, true);
    }
    assert_eq!(seen, w.longest_request());
    assert_eq!(
        build("kind = \"open_loop\"\nrate = 1.0\nnum_requests = 5\ninput_len = [10, 300]\noutput_len = [1, 20]")
            .longest_request(),
        320
    );
}
