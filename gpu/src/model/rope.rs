//! Rotary position frequencies, and the `rope_scaling` of `config.json` that stretches
//! them for contexts longer than the model was trained on.
//!
//! Supported: `linear` (every frequency divided by `factor`: positions interpolated)
//! and `llama3` (Llama 3.1 and later: frequencies whose wavelength exceeds the original
//! context divided by `factor`, those much shorter kept, the band between blended
//! linearly in the inverse wavelength). Anything else is refused at load, naming the
//! type, rather than run with the wrong positions.

use serde_json::Value;

/// How the rotary frequencies are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScaling {
    /// As trained.
    #[default]
    None,
    /// Every frequency divided by `factor`.
    Linear {
        /// The stretch.
        factor: f64,
    },
    /// Llama 3's frequency-dependent stretch.
    Llama3 {
        /// The stretch of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are stretched fully.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was trained on.
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    /// Reads `rope_scaling` (absent or null: none). The error names the field and value.
    pub fn parse(value: Option<&Value>) -> Result<RopeScaling, String> {
        Self::parse_in(value, "rope_scaling")
    }

    /// Reads the scaling fields of the object `key` of `config.json` (`rope_scaling`, or
    /// transformers 5's `rope_parameters`, where `rope_type` may be absent: default).
    pub fn parse_in(value: Option<&Value>, key: &str) -> Result<RopeScaling, String> {
        let Some(v) = value.filter(|v| !v.is_null()) else {
            return Ok(RopeScaling::None);
        };
        // Older configs say `type`, newer ones `rope_type`.
        let kind = match v.get("rope_type").or_else(|| v.get("type")) {
            Some(kind) => kind
                .as_str()
                .ok_or_else(|| format!("{key}.rope_type must be a string, got {kind}"))?,
            None if key == "rope_parameters" => "default",
            None => return Err(format!("{key} has no rope_type")),
        };
        let number = |field: &str| -> Result<f64, String> {
            let x = v
                .get(field)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("{key}.{field} is missing (rope_type {kind:?})"))?;
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err(format!("{key}.{field} must be positive, got {x}"))
            }
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: number("factor")?,
            }),
            "llama3" => {
                let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
                if high <= low {
                    return Err(format!(
                        "{key}.high_freq_factor {high} must exceed low_freq_factor {low}"
                    ));
                }
                Ok(RopeScaling::Llama3 {
                    factor: number("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: number("original_max_position_embeddings")?,
                })
            }
            other => Err(format!(
                "{key}.rope_type {other:?} is not supported by the CPU backend (supported: linear, llama3)"
            )),
        }
    }

    /// The `rope_scaling` object as `config.json` writes it (`None` for none).
    pub fn to_json(&self) -> Option<Value> {
        match *self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => {
                Some(serde_json::json!({"rope_type": "linear", "factor": factor}))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            })),
        }
    }

    /// The `head_dim / 2` inverse frequencies: `theta^(-2i / head_dim)`, scaled.
    pub fn inverse_frequencies(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let f = theta.powf(-2.0 * i as f64 / head_dim as f64);
                match *self {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: original,
                    } => {
                        let wavelength = std::f64::consts::TAU / f;
                        if wavelength > original / low_freq_factor {
                            f / factor
                        } else if wavelength < original / high_freq_factor {
                            f
                        } else {
                            // 0 at the long end of the band, 1 at the short end.
                            let blend = (original / wavelength - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - blend) * f / factor + blend * f
                        }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Llama 3.1's published scaling.
    fn llama31() -> RopeScaling {
        RopeScaling::parse(Some(&json!({
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        })))
        .expect("parses")
    }

    #[test]
    fn llama3_scaling_keeps_short_wavelengths_stretches_long_ones_and_blends_between() {
        let (head_dim, theta) = (128, 500_000.0);
        let plain = RopeScaling::None.inverse_frequencies(head_dim, theta);
        let scaled = llama31().inverse_frequencies(head_dim, theta);
        let wavelength = |f: f64| std::f64::consts::TAU / f;
        let (mut kept, mut stretched, mut blended) = (0, 0, 0);
        for (&p, &s) in plain.iter().zip(&scaled) {
            if wavelength(p) < 2048.0 {
                assert_eq!(s, p);
                kept += 1;
            } else if wavelength(p) > 8192.0 {
                assert!((s - p / 8.0).abs() <= 1e-15 * p, "{s} vs {p}/8");
                stretched += 1;
            } else {
                assert!(s < p && s > p / 8.0, "{s} between {p}/8 and {p}");
                blended += 1;
            }
        }
        assert!(
            kept > 0 && stretched > 0 && blended > 0,
            "{kept} {stretched} {blended}"
        );
        // Frequencies still fall monotonically: no two positions swap their order.
        assert!(scaled.windows(2).all(|w| w[1] < w[0]));
        // The blend meets both ends: at wavelength 8192 it is f / 8, at 2048 it is f.
        let at = |wavelength: f64| {
            let f = std::f64::consts::TAU / wavelength;
            let blend = (8192.0 / wavelength - 1.0) / 3.0;
            (1.0 - blend) * f / 8.0 + blend * f
        };
        assert!((at(8192.0) - std::f64::consts::TAU / 8192.0 / 8.0).abs() < 1e-18);
        assert!((at(2048.0) - std::f64::consts::TAU / 2048.0).abs() < 1e-18);
    }

    #[test]
    fn linear_scaling_divides_every_frequency_and_none_keeps_them() {
        let plain = RopeScaling::None.inverse_frequencies(8, 10_000.0);
        assert_eq!(plain[0], 1.0);
        assert!((plain[1] - 0.1).abs() < 1e-12, "{}", plain[1]);
        let linear = RopeScaling::parse(Some(&json!({"type": "linear", "factor": 4.0})))
            .unwrap()
            .inverse_frequencies(8, 10_000.0);
        for (l, p) in linear.iter().zip(&plain) {
            assert_eq!(*l, p / 4.0);
        }
        assert_eq!(
            RopeScaling::parse(Some(&Value::Null)),
            Ok(RopeScaling::None)
        );
        let back = RopeScaling::parse(llama31().to_json().as_ref()).unwrap();
        assert_eq!(back, llama31());
    }

    #[test]
    fn a_scaling_the_backend_cannot_apply_is_refused_naming_the_field() {
        let err = |v: Value| RopeScaling::parse(Some(&v)).unwrap_err();
        assert!(err(json!({"rope_type": "yarn", "factor": 4.0})).contains("rope_type \"yarn\""),);
        assert!(
            err(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
                .contains("rope_scaling.original_max_position_embeddings is missing")
        );
        assert!(err(json!({"rope_type": "linear", "factor": -2.0})).contains("got -2"));
        assert!(err(json!({"factor": 2.0})).contains("no rope_type"));
    }
}
