//! The GPU table: memory, bandwidth, dense tensor throughput per precision and the
//! links between GPUs, per GPU and with the public source of every number. A custom GPU
//! is the same fields in a `[hardware]`-style table.
//!
//! Throughput is dense (NVIDIA's headline figures count 2:4 structured sparsity, twice
//! these). Rack-scale parts (GB200, GB300) are quoted by NVIDIA per NVL72 rack; the
//! per-GPU figure here is the rack's divided by its 72 GPUs. Memory is the usable size
//! NVIDIA quotes in gigabytes, read as GiB (what `nvidia-smi` shows is close to it).
//!
//! The link latencies are not datasheet figures: they are the order of a small-message
//! NCCL collective step (a few microseconds within NVLink, about ten across an
//! InfiniBand hop), assumptions to override with a custom table when measured.

use serde::{Deserialize, Serialize};

use super::Precision;

/// One GPU and its links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// The name the table and errors use.
    #[serde(default = "custom_name")]
    pub name: String,
    /// Usable HBM in GiB.
    pub memory_gib: f64,
    /// HBM bandwidth in TB/s (10^12 bytes per second).
    pub memory_tb_per_s: f64,
    /// Dense BF16 tensor throughput in TFLOPS.
    pub bf16_tflops: f64,
    /// Dense FP8 tensor throughput in TFLOPS; absent: no FP8 tensor cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tflops: Option<f64>,
    /// Dense FP4 (NVFP4) tensor throughput in TFLOPS; absent: no FP4 tensor cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_tflops: Option<f64>,
    /// NVLink bandwidth per GPU in GB/s as datasheets quote it: both directions
    /// together (a collective moves data at half of it each way).
    pub nvlink_gb_per_s: f64,
    /// GPUs one NVLink domain joins (8 in an HGX board, 72 in an NVL72 rack).
    pub nvlink_domain_gpus: u32,
    /// Latency of one collective step over NVLink, in microseconds.
    pub nvlink_latency_us: f64,
    /// Network (inter-node) bandwidth per GPU in GB/s, one direction (its NIC's line
    /// rate).
    pub network_gb_per_s: f64,
    /// Latency of one collective step across nodes, in microseconds.
    pub network_latency_us: f64,
}

fn custom_name() -> String {
    "custom".into()
}

/// A GPU table entry that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// No GPU of that name.
    #[error("unknown GPU `{name}`; known GPUs: {}", .known.join(", "))]
    Unknown {
        /// The name asked for.
        name: String,
        /// The table's names.
        known: Vec<String>,
    },
    /// A field out of range in a custom table.
    #[error("hardware.{field} = {value}: must be a finite number above 0")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// The precision has no tensor cores on this GPU.
    #[error("GPU `{gpu}` has no {precision} tensor cores (hardware.{field} is absent)")]
    NoTensorCores {
        /// The GPU.
        gpu: String,
        /// The precision asked for.
        precision: Precision,
        /// The field a custom table would give.
        field: &'static str,
    },
}

impl Gpu {
    /// Checks every number of a custom table; the error names the field.
    pub fn validate(&self) -> Result<(), GpuError> {
        let fields = [
            ("memory_gib", Some(self.memory_gib)),
            ("memory_tb_per_s", Some(self.memory_tb_per_s)),
            ("bf16_tflops", Some(self.bf16_tflops)),
            ("fp8_tflops", self.fp8_tflops),
            ("fp4_tflops", self.fp4_tflops),
            ("nvlink_gb_per_s", Some(self.nvlink_gb_per_s)),
            (
                "nvlink_domain_gpus",
                Some(f64::from(self.nvlink_domain_gpus)),
            ),
            ("network_gb_per_s", Some(self.network_gb_per_s)),
        ];
        for (field, value) in fields {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(GpuError::OutOfRange { field, value: v });
            }
        }
        for (field, v) in [
            ("nvlink_latency_us", self.nvlink_latency_us),
            ("network_latency_us", self.network_latency_us),
        ] {
            // A latency of 0 is a valid idealisation; below 0 is not.
            if !(v.is_finite() && v >= 0.0) {
                return Err(GpuError::OutOfRange { field, value: v });
            }
        }
        Ok(())
    }

    /// Dense tensor throughput in FLOP/s for GEMMs whose weights are in `precision`
    /// (activations quantized to match, as FP8 and NVFP4 serving kernels do).
    pub fn tensor_flops(&self, precision: Precision) -> Result<f64, GpuError> {
        let (tflops, field) = match precision {
            Precision::Bf16 => (Some(self.bf16_tflops), "bf16_tflops"),
            Precision::Fp8 => (self.fp8_tflops, "fp8_tflops"),
            Precision::Nvfp4 => (self.fp4_tflops, "fp4_tflops"),
        };
        tflops
            .map(|t| t * 1e12)
            .ok_or_else(|| GpuError::NoTensorCores {
                gpu: self.name.clone(),
                precision,
                field,
            })
    }

    /// HBM bytes in total.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gib * GIB
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// NVLink step latency assumed for every shipped GPU (see the module comment).
const NVLINK_LATENCY_US: f64 = 5.0;
/// Inter-node step latency assumed for every shipped GPU (see the module comment).
const NETWORK_LATENCY_US: f64 = 10.0;

/// The shipped GPUs, in a fixed order.
pub fn gpus() -> Vec<Gpu> {
    vec![
        // NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-
        // 1758950-r4-web.pdf), SXM column: 80 GB HBM2e at 2,039 GB/s; BF16 312 TFLOPS
        // (624 with sparsity); no FP8; NVLink 600 GB/s. DGX A100 user guide: eight
        // 200 Gb/s HDR InfiniBand ports for eight GPUs, so 25 GB/s per GPU.
        Gpu {
            name: "A100-80G".into(),
            memory_gib: 80.0,
            memory_tb_per_s: 2.039,
            bf16_tflops: 312.0,
            fp8_tflops: None,
            fp4_tflops: None,
            nvlink_gb_per_s: 600.0,
            nvlink_domain_gpus: 8,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 25.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
        // NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100),
        // H100 SXM column: 80 GB HBM3 at 3.35 TB/s; BF16 1,979 and FP8 3,958 TFLOPS
        // with sparsity, so 989 and 1,979 dense; NVLink 900 GB/s. DGX H100: eight
        // ConnectX-7 400 Gb/s NDR ports for eight GPUs, 50 GB/s per GPU.
        Gpu {
            name: "H100-SXM".into(),
            memory_gib: 80.0,
            memory_tb_per_s: 3.35,
            bf16_tflops: 989.0,
            fp8_tflops: Some(1979.0),
            fp4_tflops: None,
            nvlink_gb_per_s: 900.0,
            nvlink_domain_gpus: 8,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 50.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
        // NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200),
        // H200 SXM column: 141 GB HBM3e at 4.8 TB/s; tensor throughput as H100 SXM
        // (BF16 1,979 / FP8 3,958 TFLOPS with sparsity); NVLink 900 GB/s. HGX H200 with
        // one 400 Gb/s NIC per GPU.
        Gpu {
            name: "H200".into(),
            memory_gib: 141.0,
            memory_tb_per_s: 4.8,
            bf16_tflops: 989.0,
            fp8_tflops: Some(1979.0),
            fp4_tflops: None,
            nvlink_gb_per_s: 900.0,
            nvlink_domain_gpus: 8,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 50.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
        // NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx), eight
        // GPUs: 1.4 TB HBM3e (180 GB each, as DGX B200's 1,440 GB) at 64 TB/s (8 TB/s
        // each); FP4 144, FP8 72, BF16 36 PFLOPS with sparsity, so 9, 4.5 and 2.25
        // PFLOPS dense per GPU; NVLink 5 1.8 TB/s per GPU. DGX B200: eight ConnectX-7
        // 400 Gb/s ports.
        Gpu {
            name: "B200".into(),
            memory_gib: 180.0,
            memory_tb_per_s: 8.0,
            bf16_tflops: 2250.0,
            fp8_tflops: Some(4500.0),
            fp4_tflops: Some(9000.0),
            nvlink_gb_per_s: 1800.0,
            nvlink_domain_gpus: 8,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 50.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
        // NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/gb200-nvl72),
        // per rack of 72 GPUs: up to 13.4 TB HBM3e (186 GB each) at 576 TB/s (8 TB/s
        // each); FP4 1,440, FP8 720, BF16 360 PFLOPS with sparsity, so 10, 5 and 2.5
        // PFLOPS dense per GPU; NVLink 130 TB/s (1.8 TB/s per GPU) across all 72.
        // ConnectX-7 400 Gb/s per GPU for the scale-out network.
        Gpu {
            name: "GB200".into(),
            memory_gib: 186.0,
            memory_tb_per_s: 8.0,
            bf16_tflops: 2500.0,
            fp8_tflops: Some(5000.0),
            fp4_tflops: Some(10_000.0),
            nvlink_gb_per_s: 1800.0,
            nvlink_domain_gpus: 72,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 50.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
        // NVIDIA GB300 NVL72 specifications (nvidia.com/en-us/data-center/gb300-nvl72),
        // per rack of 72 GPUs: up to 20 TB HBM3e (279 GB each) at 576 TB/s (8 TB/s
        // each); FP4 1,080 PFLOPS dense (1,440 with sparsity), FP8 720 and BF16 360
        // PFLOPS with sparsity, so 15, 5 and 2.5 PFLOPS dense per GPU; NVLink 130 TB/s
        // (1.8 TB/s per GPU); ConnectX-8 800 Gb/s per GPU, 100 GB/s.
        Gpu {
            name: "GB300".into(),
            memory_gib: 279.0,
            memory_tb_per_s: 8.0,
            bf16_tflops: 2500.0,
            fp8_tflops: Some(5000.0),
            fp4_tflops: Some(15_000.0),
            nvlink_gb_per_s: 1800.0,
            nvlink_domain_gpus: 72,
            nvlink_latency_us: NVLINK_LATENCY_US,
            network_gb_per_s: 100.0,
            network_latency_us: NETWORK_LATENCY_US,
        },
    ]
}

/// The shipped GPU called `name` (case-insensitive).
pub fn gpu(name: &str) -> Result<Gpu, GpuError> {
    let all = gpus();
    let known = all.iter().map(|g| g.name.clone()).collect();
    all.into_iter()
        .find(|g| g.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| GpuError::Unknown {
            name: name.to_string(),
            known,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_gpu_is_valid_and_found_by_name() {
        let all = gpus();
        assert_eq!(all.len(), 6);
        for g in &all {
            g.validate().unwrap();
            assert_eq!(&gpu(&g.name.to_lowercase()).unwrap(), g);
            // FP8 is twice BF16 (to rounding) and FP4 at least twice FP8 wherever
            // they exist.
            if let Some(fp8) = g.fp8_tflops {
                assert!((fp8 / g.bf16_tflops - 2.0).abs() < 0.01, "{}", g.name);
            }
            if let (Some(fp8), Some(fp4)) = (g.fp8_tflops, g.fp4_tflops) {
                assert!(fp4 >= 2.0 * fp8, "{}", g.name);
            }
        }
    }

    #[test]
    fn an_unknown_gpu_lists_the_table() {
        let msg = gpu("V100").unwrap_err().to_string();
        assert!(msg.contains("`V100`") && msg.contains("H200") && msg.contains("GB300"));
    }

    #[test]
    fn a_custom_table_names_a_missing_or_bad_field() {
        let text = r#"{"memory_gib": 96, "memory_tb_per_s": 4.0, "bf16_tflops": 900,
            "nvlink_gb_per_s": 900, "nvlink_domain_gpus": 8, "nvlink_latency_us": 5,
            "network_gb_per_s": 50}"#;
        let err = serde_json::from_str::<Gpu>(text).unwrap_err().to_string();
        assert!(err.contains("network_latency_us"), "{err}");
        let text = text.replace(
            "\"network_gb_per_s\": 50",
            "\"network_gb_per_s\": 50, \"network_latency_us\": 10",
        );
        let mut g: Gpu = serde_json::from_str(&text).unwrap();
        assert_eq!(g.name, "custom");
        g.validate().unwrap();
        g.memory_tb_per_s = 0.0;
        let msg = g.validate().unwrap_err().to_string();
        assert!(msg.contains("hardware.memory_tb_per_s = 0"), "{msg}");
        let msg = g.tensor_flops(Precision::Fp8).unwrap_err().to_string();
        assert!(msg.contains("fp8_tflops"), "{msg}");
    }
}
