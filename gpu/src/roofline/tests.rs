//! The roofline against hand calculations on the shipped configs.

use std::path::PathBuf;

use super::*;
use crate::cost::{AnalyticBackend, Backend};

fn config(name: &str) -> Architecture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../data/models")
        .join(name)
        .join("config.json");
    Architecture::from_file(&path).unwrap()
}

fn deploy(name: &str, gpu_name: &str, tp: u32, ep: u32, w: Precision, kv: Precision) -> Deployment {
    Deployment::new(
        config(name),
        gpu(gpu_name).unwrap(),
        Parallelism { tp, ep },
        w,
        kv,
        Efficiency::default(),
    )
    .unwrap()
}

fn bf16(name: &str, gpu_name: &str) -> Deployment {
    deploy(name, gpu_name, 1, 1, Precision::Bf16, Precision::Bf16)
}

#[test]
fn llama_3_8b_parameters_and_kv_by_hand() {
    let d = bf16("llama-3-8b", "H100-SXM");
    let p = d.parameters;
    // Per layer: q 4096·4096, k and v 4096·(8·128) each, o 4096·4096; SwiGLU
    // 3·4096·14336; two norms of 4096.
    let attention = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096;
    assert_eq!(attention, 41_943_040);
    let mlp = 3 * 4096 * 14336;
    assert_eq!(mlp, 176_160_768);
    let per_layer = attention + mlp + 2 * 4096;
    // Embedding and untied LM head 128256·4096 each, final norm 4096.
    let total = 32 * per_layer + 2 * 128_256 * 4096 + 4096;
    assert_eq!(total, 8_030_261_248);
    assert_eq!(p.total(), total);
    assert_eq!(p.active(), total);
    // KV: 2 (K, V) · 32 layers · 8 heads · 128 · 2 bytes.
    assert_eq!(d.kv_geometry().bytes_per_token(), 2 * 32 * 8 * 128 * 2);
    assert_eq!(d.kv_geometry().bytes_per_token(), 131_072);
}

#[test]
fn llama_3_70b_parameters_and_kv_by_hand() {
    let d = deploy("llama-3-70b", "H200", 8, 1, Precision::Fp8, Precision::Fp8);
    // Per layer: q and o 8192·8192 each, k and v 8192·1024 each, SwiGLU 3·8192·28672,
    // two norms.
    let per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192;
    assert_eq!(per_layer, 855_654_400);
    let total: u64 = 80 * per_layer + 2 * 128_256 * 8192 + 8192;
    assert_eq!(total, 70_553_706_496);
    assert_eq!(d.parameters.total(), total);
    // FP8 KV: 2 · 80 · 8 · 128 · 1 byte; per GPU at tp 8 one KV head.
    assert_eq!(d.kv_geometry().bytes_per_token(), 163_840);
    assert_eq!(d.kv_bytes_per_token_per_gpu(), 163_840.0 / 8.0);
}

#[test]
fn qwen2_5_7b_counts_its_qkv_biases() {
    let d = bf16("qwen2.5-7b", "H100-SXM");
    // q and o 3584·3584, k and v 3584·(4·128); biases on q (3584), k and v (512 each).
    let attention = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512);
    let per_layer = attention + 3 * 3584 * 18944 + 2 * 3584;
    let total: u64 = 28 * per_layer + 2 * 152_064 * 3584 + 3584;
    assert_eq!(total, 7_615_616_512);
    assert_eq!(d.parameters.total(), total);
    // 2 · 28 layers · 4 heads · 128 · 2 bytes.
    assert_eq!(d.kv_geometry().bytes_per_token(), 57_344);
}

#[test]
fn mixtral_counts_all_experts_but_activates_two() {
    let d = bf16("mixtral-8x7b", "H100-SXM");
    let p = d.parameters;
    let attention = 2 * 4096 * 4096 + 2 * 4096 * 1024;
    let expert = 3 * 4096 * 14336;
    let router = 4096 * 8;
    let norms = 2 * 4096;
    let total: u64 = 32 * (attention + 8 * expert + router + norms) + 2 * 32_000 * 4096 + 4096;
    assert_eq!(total, 46_702_792_704);
    assert_eq!(p.total(), total);
    let active: u64 = 32 * (attention + 2 * expert + router + norms) + 2 * 32_000 * 4096 + 4096;
    assert_eq!(active, 12_879_925_248);
    assert_eq!(p.active(), active);
    assert_eq!(d.kv_geometry().bytes_per_token(), 131_072);
}

#[test]
fn deepseek_v3_counts_latent_attention_dense_layers_and_shared_experts() {
    let d = deploy("deepseek-v3", "H200", 1, 8, Precision::Fp8, Precision::Fp8);
    let p = d.parameters;
    // MLA per layer: q_a 7168·1536 + its norm 1536 + q_b 1536·128·(128+64);
    // kv_a 7168·(512+64) + its norm 512 + kv_b 512·128·(128+128); o 128·128·7168.
    let attention = 7168 * 1536
        + 1536
        + 1536 * 128 * 192
        + 7168 * 576
        + 512
        + 512 * 128 * 256
        + 128 * 128 * 7168;
    assert_eq!(attention, 187_107_328);
    let dense = 3 * 7168 * 18432;
    let expert = 3 * 7168 * 2048;
    let shared = expert;
    let router = 7168 * 256;
    let norms = 2 * 7168;
    // 3 dense layers, 58 MoE layers of 256 routed experts; untied embedding and head.
    let embedding = 129_280 * 7168;
    let total: u64 = 61 * (attention + norms)
        + 3 * dense
        + 58 * (256 * expert + shared + router)
        + 2 * embedding
        + 7168;
    assert_eq!(total, 671_026_404_352);
    assert_eq!(p.total(), total);
    let active: u64 = 61 * (attention + norms)
        + 3 * dense
        + 58 * (8 * expert + shared + router)
        + 2 * embedding
        + 7168;
    assert_eq!(active, 37_552_282_624);
    assert_eq!(p.active(), active);
    // MLA caches the 512-element latent and the 64-element RoPE key once per layer:
    // 61 · 576 · 1 byte in FP8.
    assert!(d.kv_geometry().mla);
    assert_eq!(d.kv_geometry().bytes_per_token(), 61 * 576);
    assert_eq!(d.kv_geometry().bytes_per_token(), 35_136);
}

#[test]
fn nvfp4_kv_packs_sixteen_elements_into_nine_bytes() {
    let d = deploy(
        "llama-3-8b",
        "B200",
        1,
        1,
        Precision::Nvfp4,
        Precision::Nvfp4,
    );
    // 2 · 32 · 8 heads · 128 elements · 9/16 byte.
    assert_eq!(d.kv_geometry().bytes_per_token(), 2 * 32 * 8 * 128 * 9 / 16);
    // Hopper has no FP4 tensor cores.
    let err = Deployment::new(
        config("llama-3-8b"),
        gpu("H100-SXM").unwrap(),
        Parallelism { tp: 1, ep: 1 },
        Precision::Nvfp4,
        Precision::Bf16,
        Efficiency::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("fp4_tflops"), "{err}");
}

#[test]
fn a_shipped_config_missing_a_needed_field_is_named() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/models/deepseek-v3/config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.replace("\"kv_lora_rank\": 512,", "\"kv_lora_rank\": 512, \"x\": 0,");
    let text = text.replace("\"qk_rope_head_dim\": 64,", "");
    let err = Architecture::from_json(&text, "deepseek-v3/config.json").unwrap_err();
    assert_eq!(
        err.to_string(),
        "deepseek-v3/config.json: missing field `qk_rope_head_dim` (multi-head latent attention (kv_lora_rank is set))"
    );
    let err = Architecture::from_file(&path.with_file_name("absent.json")).unwrap_err();
    assert!(
        err.to_string().contains("absent.json: cannot read"),
        "{err}"
    );
}

#[test]
fn flops_per_token_are_twice_the_active_parameters_at_short_context() {
    for name in [
        "llama-3-8b",
        "llama-3-70b",
        "qwen2.5-7b",
        "mixtral-8x7b",
        "deepseek-v3",
    ] {
        let d = bf16(name, "B200");
        // 64 decode steps over 16 cached tokens: attention is a rounding error, and
        // every token samples, so the LM head counts.
        let b = ForwardBatch::decode(64, 16);
        let per_token = d.forward(&b).flops() / 64.0;
        let matmul = 2.0 * d.parameters.active_matmul() as f64;
        assert!(
            (per_token / matmul - 1.0).abs() < 0.01,
            "{name}: {per_token:e} FLOPs per token vs 2 x active matmul {matmul:e}"
        );
        // Against 2 × all active parameters the embedding lookup is the difference.
        let active = 2.0 * d.parameters.active() as f64;
        assert!(
            (per_token / active - 1.0).abs() < 0.1,
            "{name}: {per_token:e} vs {active:e}"
        );
    }
}

#[test]
fn tensor_parallelism_splits_the_flops_and_adds_all_reduces() {
    let one = deploy(
        "llama-3-70b",
        "H100-SXM",
        1,
        1,
        Precision::Fp8,
        Precision::Fp8,
    );
    let eight = deploy(
        "llama-3-70b",
        "H100-SXM",
        8,
        1,
        Precision::Fp8,
        Precision::Fp8,
    );
    let b = ForwardBatch::decode(32, 2048);
    let ratio = one.forward(&b).flops() / eight.forward(&b).flops();
    assert!((ratio - 8.0).abs() < 1e-9, "{ratio}");
    let ops = eight.forward(&b).ops;
    let ar = ops.iter().find(|o| o.op.name == "TP all-reduce").unwrap();
    // 2 per layer of 32 tokens · 8192 · 2 bytes, 2·7/8 of it sent per GPU.
    assert_eq!(ar.op.bytes, 160.0 * 32.0 * 8192.0 * 2.0 * 2.0 * 7.0 / 8.0);
    assert_eq!(ar.bound, Bound::Link);
    assert!(
        one.forward(&b)
            .ops
            .iter()
            .all(|o| o.op.name != "TP all-reduce")
    );
}

#[test]
fn decode_at_small_batch_is_memory_bound_and_a_long_prefill_compute_bound() {
    for name in ["llama-3-8b", "qwen2.5-7b", "mixtral-8x7b"] {
        let d = bf16(name, "H100-SXM");
        let decode = d.forward(&ForwardBatch::decode(4, 1024));
        for op in &decode.ops {
            assert_eq!(op.bound, Bound::Memory, "{name} decode: {op:?}");
        }
        let prefill = d.forward(&ForwardBatch::prefill(1, 8192));
        for op in prefill.ops.iter().filter(|o| o.op.name != "LM head") {
            assert_eq!(op.bound, Bound::Compute, "{name} prefill: {op:?}");
        }
    }
    // DeepSeek-V3 on EP8: decode reads the experts it touches, prefill multiplies.
    let d = deploy("deepseek-v3", "H200", 1, 8, Precision::Fp8, Precision::Fp8);
    let decode = d.forward(&ForwardBatch::decode(4, 1024));
    let experts = decode
        .ops
        .iter()
        .find(|o| o.op.name == "routed experts")
        .unwrap();
    assert_eq!(experts.bound, Bound::Memory);
    let prefill = d.forward(&ForwardBatch::prefill(1, 8192));
    let experts = prefill
        .ops
        .iter()
        .find(|o| o.op.name == "routed experts")
        .unwrap();
    assert_eq!(experts.bound, Bound::Compute);
}

#[test]
fn a_small_decode_reads_every_weight_once_at_the_memory_efficiency() {
    let d = bf16("llama-3-8b", "H100-SXM");
    let t = d.forward(&ForwardBatch::decode(1, 1));
    let weight_bytes = d.weight_bytes_per_gpu() - d.parameters.embedding as f64 * 2.0;
    let floor_ns = weight_bytes / (3.35e12 * 0.8) * 1e9;
    // All weights but the embedding, plus a few MB of activations and KV.
    assert!(
        t.ns() >= floor_ns && t.ns() < floor_ns * 1.01,
        "{} vs {floor_ns}",
        t.ns()
    );
}

#[test]
fn moe_decode_reads_only_the_experts_its_tokens_pick() {
    let d = bf16("mixtral-8x7b", "H100-SXM");
    let experts = |batch: u64| {
        d.forward(&ForwardBatch::decode(batch, 1))
            .ops
            .into_iter()
            .find(|o| o.op.name == "routed experts")
            .unwrap()
            .op
            .bytes
    };
    let expert_bytes = 32.0 * 3.0 * 4096.0 * 14336.0 * 2.0;
    // One token picks 2 of 8 experts: expected 8 · (1 - (6/8)^1) = 2 experts.
    let one = experts(1);
    assert!(
        (one / expert_bytes - 2.0).abs() < 0.01,
        "{}",
        one / expert_bytes
    );
    // Two tokens: 8 · (1 - (3/4)^2) = 3.5 experts.
    let two = experts(2);
    assert!(
        (two / expert_bytes - 3.5).abs() < 0.01,
        "{}",
        two / expert_bytes
    );
    // A large batch touches all 8.
    let many = experts(256);
    assert!(
        (many / expert_bytes - 8.0).abs() < 0.05,
        "{}",
        many / expert_bytes
    );
}

#[test]
fn expert_parallelism_with_attention_dp_adds_the_all_to_all() {
    let d = deploy("deepseek-v3", "H200", 1, 8, Precision::Fp8, Precision::Fp8);
    let t = d.forward(&ForwardBatch::decode(64, 4096));
    let a2a = t.ops.iter().find(|o| o.op.name == "EP all-to-all").unwrap();
    // 58 MoE layers; 64 tokens each go to the other 7 GPUs that hold one of their 8
    // experts, 7 · (1 - (7/8)^8) = 4.595 copies on average, dispatched in FP8 (1 byte)
    // and combined in BF16 (2 bytes) over 7168 elements.
    let copies = 7.0 * (1.0 - (7.0f64 / 8.0).powi(8));
    assert!((copies - 4.595).abs() < 1e-3, "{copies}");
    let want = 58.0 * 64.0 * copies * 7168.0 * (1.0 + 2.0);
    assert!(
        (a2a.op.bytes / want - 1.0).abs() < 1e-12,
        "{} vs {want}",
        a2a.op.bytes
    );
    assert_eq!(a2a.latency_ns, 2.0 * 58.0 * 5_000.0);
    // 16 GPUs span two HGX nodes: the network.
    let two_nodes = deploy("deepseek-v3", "H200", 1, 16, Precision::Fp8, Precision::Fp8);
    let t16 = two_nodes.forward(&ForwardBatch::decode(64, 4096));
    let slow = t16
        .ops
        .iter()
        .find(|o| o.op.name == "EP all-to-all")
        .unwrap();
    assert!(slow.ns > 5.0 * a2a.ns, "{} vs {}", slow.ns, a2a.ns);
}

#[test]
fn kv_capacity_is_the_free_memory_after_weights_times_the_fraction() {
    let d = bf16("llama-3-8b", "H100-SXM");
    const GIB: f64 = 1073741824.0;
    // BF16 weights 8,030,261,248 · 2 bytes (norms included); 80 GiB - that - 2 GiB
    // reserve, 90% of it over 131,072 bytes per token.
    let weights = 8_030_261_248.0 * 2.0;
    assert_eq!(d.weight_bytes_per_gpu(), weights);
    let want = ((80.0 * GIB - weights - 2.0 * GIB) * 0.9 / 131_072.0).floor() as u64;
    assert_eq!(d.kv_capacity_tokens(0.9, 2.0).unwrap(), want);
    assert_eq!(want, 464_799);
    // 70B in BF16 does not fit one H100.
    let big = bf16("llama-3-70b", "H100-SXM");
    let err = big.kv_capacity_tokens(0.9, 2.0).unwrap_err().to_string();
    assert!(err.contains("no room for KV"), "{err}");
    let err = d.kv_capacity_tokens(1.5, 2.0).unwrap_err().to_string();
    assert!(err.contains("free_gpu_memory_fraction = 1.5"), "{err}");
}

#[test]
fn parallel_sizes_that_do_not_split_the_model_are_refused() {
    let make = |name: &str, tp, ep| {
        Deployment::new(
            config(name),
            gpu("H200").unwrap(),
            Parallelism { tp, ep },
            Precision::Bf16,
            Precision::Bf16,
            Efficiency::default(),
        )
    };
    let msg = make("qwen2.5-7b", 8, 1).unwrap_err().to_string();
    assert!(
        msg.contains("tp = 8") && msg.contains("28 attention heads"),
        "{msg}"
    );
    let msg = make("llama-3-8b", 1, 2).unwrap_err().to_string();
    assert!(msg.contains("ep = 2"), "{msg}");
    let msg = make("mixtral-8x7b", 1, 3).unwrap_err().to_string();
    assert!(msg.contains("8 routed experts"), "{msg}");
    let eff = Efficiency {
        memory: 0.0,
        ..Efficiency::default()
    };
    let msg = Deployment::new(
        config("llama-3-8b"),
        gpu("H200").unwrap(),
        Parallelism { tp: 1, ep: 1 },
        Precision::Bf16,
        Precision::Bf16,
        eff,
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("efficiency.memory = 0"), "{msg}");
}

#[test]
fn the_derived_profile_follows_the_roofline_and_reports_its_error() {
    for (name, gpu_name, tp, ep, w) in [
        ("llama-3-8b", "H100-SXM", 1, 1, Precision::Bf16),
        ("llama-3-70b", "H200", 8, 1, Precision::Fp8),
        ("deepseek-v3", "H200", 1, 8, Precision::Fp8),
    ] {
        let d = deploy(name, gpu_name, tp, ep, w, w);
        let derived = derive_profile(&d, "derived").unwrap();
        let f = derived.fit;
        assert_eq!(derived.profile.kv, d.kv_geometry());
        assert!(f.held_out > 20 && f.fitted > 30, "{f:?}");
        // The linear model cannot bend at the roofline's knee; it stays within tens of
        // percent of it, and the report says how far.
        assert!(f.held_out_mean_error < 0.3, "{name}: {f:?}");
        assert!(f.held_out_max_error >= f.held_out_mean_error);
        assert!(derived.profile.assumptions.contains("held-out"));
        for (term, v) in derived.profile.coefficients.terms() {
            assert!(v.is_finite() && v >= 0.0, "{name} {term} = {v}");
        }
        // The simulator's backend, on a held-out prefill, is near the roofline.
        let b = ForwardBatch::prefill(1, 6144);
        let sim = AnalyticBackend::new(derived.profile.coefficients).forward_ns(&b.shape()) as f64;
        let t = d.forward(&b);
        let roof = t.ns() - t.latency_ns();
        assert!(
            (sim / roof - 1.0).abs() < 0.3,
            "{name}: sim {sim} vs roofline {roof}"
        );
    }
}
