//! `lockstep import trtllm`, `lockstep export trtllm` and `lockstep explain` end to end
//! through the binary: the shipped TensorRT-LLM YAMLs become scenarios the simulator
//! runs, export → import gives the same scenario, bad YAML names the key and the file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lockstep_plan::scenario::Scenario;

mod scratch;
use scratch::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn lockstep(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(root())
        .output()
        .expect("run lockstep")
}

/// Runs `lockstep ARGS`, which must succeed: (stdout, stderr).
fn ok(args: &[&str]) -> (String, String) {
    let out = lockstep(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {:?}\n{stderr}", out.status);
    (String::from_utf8(out.stdout).unwrap(), stderr)
}

/// Runs `lockstep ARGS`, which must fail: its stderr.
fn fails(args: &[&str]) -> String {
    let out = lockstep(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const AGG: &str = "examples/trtllm/agg-llama3-8b.yml";
const DISAGG: &str = "examples/trtllm/disagg-deepseek-v3.yml";
const LLAMA: &str = "data/models/llama-3-8b/config.json";

fn import_agg(out: &str) -> String {
    let (_, stderr) = ok(&[
        "import",
        "trtllm",
        AGG,
        "--hf-config",
        LLAMA,
        "--gpu",
        "H100-SXM",
        "-o",
        out,
    ]);
    stderr
}

fn import_disagg(yaml: &str, out: &str) -> String {
    let (_, stderr) = ok(&[
        "import",
        "trtllm",
        yaml,
        "--gpu",
        "H200",
        "--weight-precision",
        "fp8",
        "--num-requests",
        "64",
        "--concurrency",
        "32",
        "-o",
        out,
    ]);
    stderr
}

fn sim_completes(scenario: &str) {
    let (stdout, _) = ok(&["sim", scenario]);
    assert!(stdout.contains("outcome completed"), "{stdout}");
}

#[test]
fn an_aggregated_config_imports_lists_what_it_does_not_model_and_simulates() {
    let tmp = TempDir::new("agg");
    let out = tmp.file("agg.toml");
    let stderr = import_agg(&out);
    // Listed on stderr and kept in the scenario's header, never dropped silently.
    for key in ["cuda_graph_config", "print_iter_log"] {
        assert!(stderr.contains(&format!("not modeled: {key}")), "{stderr}");
    }
    // ADP balance is modeled: imported, not listed.
    assert!(!stderr.contains("attention_dp_config"), "{stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("#   cuda_graph_config = "), "{text}");
    let s = Scenario::load(Path::new(&out)).unwrap();
    assert_eq!(s.servers.len(), 1);
    let server = &s.servers[0];
    assert_eq!(server.tensor_parallel_size, 2);
    assert!(server.enable_attention_dp && server.enable_chunked_prefill);
    assert_eq!(server.max_batch_size, 64);
    let adp = &server.attention_dp_config;
    assert!(adp.enable_balance);
    assert_eq!((adp.timeout_iters, adp.batching_wait_iters), (60, 0));
    // 80 GiB - 16.06e9 B of BF16 weights - 2 GiB reserve, 85% of it, over 131,072 B.
    let gib = 1024.0 * 1024.0 * 1024.0;
    let want = ((80.0 * gib - 8_030_261_248.0 * 2.0 - 2.0 * gib) * 0.85 / 131_072.0) as i64;
    assert_eq!(server.kv_cache_config.max_tokens, want);
    assert_eq!(s.model.free_gpu_memory_fraction, Some(0.85));
    let profile = s.model.resolve(&s.base_dir).unwrap();
    assert_eq!(profile.kv.bytes_per_token(), 131_072);
    sim_completes(&out);
}

#[test]
fn a_disaggregated_config_imports_every_instance_and_simulates() {
    let tmp = TempDir::new("disagg");
    let out = tmp.file("disagg.toml");
    let stderr = import_disagg(DISAGG, &out);
    assert!(
        stderr.contains("not modeled: generation_servers.moe_config.backend"),
        "{stderr}"
    );
    assert!(
        stderr.contains("not modeled: context_servers.urls"),
        "{stderr}"
    );
    let s = Scenario::load(Path::new(&out)).unwrap();
    let names: Vec<&str> = s.servers.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["ctx0", "ctx1", "gen0"]);
    // MTP's one next-token layer is one draft token.
    assert_eq!(s.servers[2].max_draft_len, 1);
    assert_eq!(s.servers[2].max_batch_size, 128);
    assert_eq!(
        s.servers[0].cache_transceiver_config.max_tokens_in_buffer,
        16384
    );
    // The profile is the generation servers': attention DP (a rank is one GPU), EP 8.
    assert_eq!((s.model.tp, s.model.ep), (Some(1), Some(8)));
    let profile = s.model.resolve(&s.base_dir).unwrap();
    assert_eq!(profile.kv.bytes_per_token(), 61 * 576);
    sim_completes(&out);
}

fn same_scenario(a: &str, b: &str) {
    let a = Scenario::load(Path::new(a)).unwrap();
    let b = Scenario::load(Path::new(b)).unwrap();
    assert_eq!(a.servers, b.servers);
    assert_eq!(a.model, b.model);
    assert_eq!(a.workload, b.workload);
    assert_eq!(a.policy, b.policy);
}

#[test]
fn export_then_import_gives_the_same_scenario() {
    let tmp = TempDir::new("round-trip");
    // Disaggregated: the YAML carries the model's path, relative to itself.
    let first = tmp.file("disagg.toml");
    import_disagg(DISAGG, &first);
    let yaml = tmp.file("exported/disagg.yml");
    std::fs::create_dir_all(tmp.0.join("exported")).unwrap();
    let (_, stderr) = ok(&["export", "trtllm", &first, "-o", &yaml]);
    assert!(
        stderr.contains("not in TensorRT-LLM's YAML: [workload]"),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&yaml).unwrap();
    assert!(
        text.contains("context_servers:") && text.contains("num_instances: 2"),
        "{text}"
    );
    let second = tmp.file("again.toml");
    import_disagg(&yaml, &second);
    same_scenario(&first, &second);
    // To stdout, the model's path is relative to the current folder.
    let (stdout, _) = ok(&["export", "trtllm", &first]);
    assert!(
        stdout.contains("\nmodel: data/models/deepseek-v3/config.json\n"),
        "{stdout}"
    );
    // And a second export writes the same YAML.
    let (again, _) = ok(&["export", "trtllm", &second]);
    let (once, _) = ok(&["export", "trtllm", &first]);
    assert_eq!(again, once);

    // Aggregated: an extra-llm-api-config.yml does not name its model.
    let first = tmp.file("agg.toml");
    import_agg(&first);
    let yaml = tmp.file("agg.yml");
    ok(&["export", "trtllm", &first, "-o", &yaml]);
    let second = tmp.file("agg-again.toml");
    ok(&[
        "import",
        "trtllm",
        &yaml,
        "--hf-config",
        LLAMA,
        "--gpu",
        "H100-SXM",
        "-o",
        &second,
    ]);
    same_scenario(&first, &second);
}

#[test]
fn bad_yaml_names_the_key_and_the_file() {
    let tmp = TempDir::new("bad");
    let disagg = std::fs::read_to_string(root().join(DISAGG)).unwrap();
    let model_path = root().join("data/models/deepseek-v3").display().to_string();
    let disagg = disagg.replace("../../data/models/deepseek-v3", &model_path);
    let write = |name: &str, text: &str| {
        let path = tmp.file(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let out = tmp.file("out.toml");
    let import = |yaml: &str| {
        fails(&[
            "import",
            "trtllm",
            yaml,
            "--gpu",
            "H200",
            "--weight-precision",
            "fp8",
            "-o",
            &out,
        ])
    };

    let path = write(
        "wrong-type.yml",
        &disagg.replace("max_batch_size: 128", "max_batch_size: lots"),
    );
    let err = import(&path);
    assert!(
        err.contains(&path) && err.contains("generation_servers.max_batch_size"),
        "{err}"
    );
    assert!(err.contains("\"lots\""), "{err}");

    let path = write(
        "wrong-table.yml",
        &disagg.replace(
            "  kv_cache_config:\n    free_gpu_memory_fraction: 0.8",
            "  kv_cache_config: 3\n  x:\n    free_gpu_memory_fraction: 0.8",
        ),
    );
    let err = import(&path);
    assert!(
        err.contains("context_servers.kv_cache_config: expected a mapping"),
        "{err}"
    );

    let path = write(
        "unknown-role.yml",
        &disagg.replace("generation_servers:", "decode_servers:"),
    );
    let err = import(&path);
    assert!(
        err.contains(&path) && err.contains("decode_servers: unknown server role"),
        "{err}"
    );

    let path = write(
        "no-model.yml",
        &disagg.replace(&format!("model: {model_path}\n"), ""),
    );
    let err = import(&path);
    assert!(
        err.contains(&path) && err.contains("missing model"),
        "{err}"
    );

    let path = write(
        "no-such-model.yml",
        &disagg.replace(&model_path, "nowhere/Nope-7B"),
    );
    let err = import(&path);
    assert!(
        err.contains("model: nowhere/Nope-7B: no config.json found"),
        "{err}"
    );

    let path = write("syntax.yml", "context_servers: [unclosed\n");
    let err = import(&path);
    assert!(
        err.contains(&path) && err.contains("not valid YAML"),
        "{err}"
    );

    let path = write(
        "bad-dtype.yml",
        &disagg.replace("dtype: fp8\n  cache_transceiver_config:\n    backend: UCX\n    max_tokens_in_buffer: 16384\n  speculative", "dtype: int2\n  cache_transceiver_config:\n    backend: UCX\n    max_tokens_in_buffer: 16384\n  speculative"),
    );
    let err = import(&path);
    assert!(
        err.contains("generation_servers.kv_cache_config.dtype: `int2`"),
        "{err}"
    );

    // Weights that do not fit name the server.
    let path = write(
        "too-small.yml",
        &disagg.replace(
            "num_instances: 2\n  tensor_parallel_size: 8",
            "num_instances: 2\n  tensor_parallel_size: 2",
        ),
    );
    let err = import(&path);
    assert!(
        err.contains("context_servers: [model] the weights need"),
        "{err}"
    );
}

#[test]
fn export_refuses_what_the_yaml_cannot_describe() {
    let tmp = TempDir::new("export-refusals");
    let first = tmp.file("disagg.toml");
    import_disagg(DISAGG, &first);
    let text = std::fs::read_to_string(&first).unwrap();
    // Make ctx1 differ from ctx0.
    let changed = text.replacen("max_batch_size = 2\n", "max_batch_size = 3\n", 2);
    let changed = changed.replacen("max_batch_size = 3\n", "max_batch_size = 2\n", 1);
    let path = tmp.file("differ.toml");
    std::fs::write(&path, changed).unwrap();
    let err = fails(&["export", "trtllm", &path]);
    assert!(err.contains("servers `ctx0` and `ctx1` differ"), "{err}");
}

#[test]
fn explain_prints_the_roofline_and_the_fit() {
    let (out, _) = ok(&["explain", "--hf-config", LLAMA, "--gpu", "H100-SXM"]);
    for want in [
        "8.03 B total, 8.03 B active",
        "KV per token:      131072 B",
        "KV capacity:       464799 tokens per rank",
        "prefill 1 x 8192 tokens:",
        "decode 64 x 1 token at 4096 context:",
        "forward_base_ns",
        "held-out shapes",
    ] {
        assert!(out.contains(want), "missing `{want}` in\n{out}");
    }
    // Prefill is compute-bound, decode memory-bound, op by op.
    let (prefill, decode) = out.split_once("decode 64").unwrap();
    let mlp = |s: &str| {
        s.lines()
            .find(|l| l.contains("dense MLP"))
            .unwrap()
            .to_string()
    };
    assert!(mlp(prefill).ends_with("compute"), "{prefill}");
    assert!(mlp(decode).ends_with("memory"), "{decode}");

    // DeepSeek-V3's config.json says its checkpoint is FP8: the weights default to it.
    let (ds, _) = ok(&[
        "explain",
        "--hf-config",
        "data/models/deepseek-v3/config.json",
        "--gpu",
        "H200",
        "--ep",
        "8",
    ]);
    assert!(ds.contains("tp 1, ep 8, weights fp8, KV bf16"), "{ds}");
    assert!(ds.contains("671.03 B total, 37.55 B active"), "{ds}");

    let (gpus, _) = ok(&["explain", "--list-gpus"]);
    assert!(
        gpus.contains("GB300") && gpus.contains("A100-80G"),
        "{gpus}"
    );

    let tmp = TempDir::new("explain");
    let text = std::fs::read_to_string(root().join(LLAMA)).unwrap();
    let broken = tmp.file("config.json");
    std::fs::write(&broken, text.replace("\"num_key_value_heads\": 8,", "")).unwrap();
    // Without num_key_value_heads the model is MHA; without hidden_size it is nothing.
    std::fs::write(&broken, text.replace("\"hidden_size\": 4096,", "")).unwrap();
    let err = fails(&["explain", "--hf-config", &broken]);
    assert!(
        err.contains(&broken) && err.contains("missing field `hidden_size`"),
        "{err}"
    );
    let err = fails(&[
        "explain",
        "--hf-config",
        LLAMA,
        "--gpu",
        "H100-SXM",
        "--weight-precision",
        "nvfp4",
    ]);
    assert!(err.contains("no nvfp4 tensor cores"), "{err}");
}

#[test]
fn export_writes_a_servers_own_experts_spread() {
    let tmp = TempDir::new("export-own-ep");
    let first = tmp.file("disagg.toml");
    import_disagg(DISAGG, &first);
    let scenario = Scenario::load(Path::new(&first)).unwrap();
    let mut text = std::fs::read_to_string(&first).unwrap();
    for s in scenario
        .servers
        .iter()
        .filter(|s| s.role == lockstep_actors::config::Role::Ctx)
    {
        text.push_str(&format!("\n[model.servers.{}]\nep = 4\n", s.name));
    }
    let path = tmp.file("own-ep.toml");
    std::fs::write(&path, &text).unwrap();
    let (yaml, _) = ok(&["export", "trtllm", &path]);
    // The YAML lists context_servers, then generation_servers.
    let (ctx_part, gen_part) = yaml.split_once("generation_servers:").expect("both roles");
    assert!(ctx_part.contains("moe_expert_parallel_size: 4"), "{yaml}");
    let gen_ep = format!(
        "moe_expert_parallel_size: {}",
        scenario.model.ep.expect("the import sets ep")
    );
    assert!(gen_part.contains(&gen_ep), "{yaml}");
    // Costed apart on one context server only: the YAML cannot say it.
    let ctx: Vec<&str> = scenario
        .servers
        .iter()
        .filter(|s| s.role == lockstep_actors::config::Role::Ctx)
        .map(|s| s.name.as_str())
        .collect();
    if ctx.len() > 1 {
        let one = std::fs::read_to_string(&first).unwrap()
            + &format!("\n[model.servers.{}]\nep = 4\n", ctx[0]);
        let path = tmp.file("one.toml");
        std::fs::write(&path, one).unwrap();
        let err = fails(&["export", "trtllm", &path]);
        assert!(err.contains("costed differently"), "{err}");
    }
}
