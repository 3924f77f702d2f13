//! kvattn in the browser: the page of `web/index.html` calls [`run`], which opens WebGPU
//! through wgpu, reports the adapter's features and limits, runs `kvattn::verify`'s quick set
//! (every kernel and KV format the adapter supports against the CPU reference, compiled into
//! this same module) and one decode step of the toy decoder, and shows each result as it comes.
//!
//! What the page found is also left for scripts: `window.kvattnResult` (the JSON of
//! [`PageResult`]), `window.kvattnProgress` (cases finished) and `window.kvattnDone` (true once
//! the result is final). `scripts/web-test.py` reads them from headless Chromium.

#[cfg(target_arch = "wasm32")]
mod page;
#[cfg(target_arch = "wasm32")]
mod toy;

use serde::Serialize;

/// What the page reports (`window.kvattnResult`).
#[derive(Debug, Default, Serialize)]
pub struct PageResult {
    /// Whether the browser offers WebGPU (`navigator.gpu`) and gave an adapter.
    pub webgpu: bool,
    /// Why the page stopped early, if it did.
    pub error: Option<String>,
    /// The adapter kvattn opened.
    pub adapter: Option<kvattn::gpu::AdapterSummary>,
    /// What the browser says of its adapter (`GPUAdapterInfo`: vendor, architecture, device,
    /// description), as the page's script read it.
    pub browser_adapter: Option<serde_json::Value>,
    /// The attention kernel kvattn picked for this adapter (`lanes` on CPU adapters).
    pub attention_kernel: String,
    /// Every feature the browser's adapter offers, as wgpu names them.
    pub adapter_features: Vec<String>,
    /// The optional features kvattn uses on this device.
    pub features: Vec<String>,
    /// The limits kvattn plans with (the device's own, read at context creation).
    pub limits: Vec<(String, u64)>,
    /// The URL's options: which part of the grid ran.
    pub selection: String,
    /// The verification cases, in grid order.
    pub cases: Vec<CaseRow>,
    /// Cases that passed.
    pub passed: usize,
    /// Cases that ran and failed.
    pub failed: usize,
    /// Cases the adapter cannot run (reported with the reason, never as passed).
    pub skipped: usize,
    /// The toy decoder's step.
    pub decode: Option<DecodeStep>,
    /// Milliseconds from navigation start to the first case's result.
    pub first_result_ms: Option<f64>,
    /// Seconds of the verification grid.
    pub verify_seconds: f64,
    /// Seconds from navigation start to the final result.
    pub total_seconds: f64,
}

/// One verification case as the page shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CaseRow {
    /// `decode`, `paged`, `dequant`, `append_kv` or `mla`.
    pub kernel: String,
    /// The case's name in the grid.
    pub name: String,
    /// Storage format(s).
    pub format: String,
    /// Kernel precision (`f32`, `f16`), empty for the codecs.
    pub precision: String,
    /// `pass`, `fail` or `skipped` (the adapter cannot run it; `note` says why).
    pub status: String,
    /// Largest absolute error, when measured.
    pub max_error: Option<f64>,
    /// Its bound (tolerance cases).
    pub bound: Option<f64>,
    /// Wall seconds of the case (both runs, compilation included).
    pub seconds: f64,
    /// Seconds of one warm run's GPU side.
    pub kernel_seconds: f64,
    /// Why it failed or was skipped.
    pub note: Option<String>,
}

impl CaseRow {
    /// The page's row of a verification case.
    pub fn new(case: &kvattn::verify::CaseReport) -> Self {
        use kvattn::verify::Status;
        Self {
            kernel: case.kernel.name().to_string(),
            name: case.name.clone(),
            format: case.format.clone(),
            precision: case
                .precision
                .map(|p| p.name().to_string())
                .unwrap_or_default(),
            status: match case.status {
                Status::Pass => "pass",
                Status::Fail => "fail",
                Status::Unavailable => "skipped",
            }
            .to_string(),
            max_error: case.max_error,
            bound: case.bound,
            seconds: case.times.seconds,
            kernel_seconds: case.times.kernel_seconds,
            note: case.note.clone(),
        }
    }
}

/// Decode steps of the toy decoder (2 layers, d_model 128, GQA 8:2, vocab 512, random weights)
/// after a prefill, each against the CPU reference forward pass: the first step compiles the
/// decode pipelines, the second runs warm.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeStep {
    /// Prompt tokens prefilled before the steps.
    pub prompt: usize,
    /// Decode steps run and checked.
    pub steps: usize,
    /// Largest logit error of any step against the CPU reference.
    pub max_error: f64,
    /// Its bound: `1e-4` of the reference logits' scale (as the native tests).
    pub bound: f64,
    /// Whether the error is within the bound (and every logit finite).
    pub passed: bool,
    /// The greedy tokens the GPU chose, one per step.
    pub tokens: Vec<u32>,
    /// The reference's greedy tokens.
    pub reference_tokens: Vec<u32>,
    /// Milliseconds of the prefill (first use: compilation included).
    pub prefill_ms: f64,
    /// Milliseconds of each decode step (the first compiles its pipelines).
    pub step_ms: Vec<f64>,
    /// Why the step could not run, if it could not.
    pub error: Option<String>,
}

/// Which part of the grid the page runs, from the URL's query: `kernels=paged,decode`,
/// `precision=f32`, `name=<text>`, `full=1` (the whole grid rather than the quick set).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// The options handed to `kvattn::verify::run_async`.
    pub options: kvattn::verify::VerifyOptions,
    /// Whether to skip the toy decoder (`decoder=0`).
    pub skip_decoder: bool,
}

impl Selection {
    /// Parses `?key=value&...` (an empty query: the quick set and the decoder step).
    pub fn parse(query: &str) -> Result<Self, String> {
        use kvattn::shader::Precision;
        let mut s = Selection {
            options: kvattn::verify::VerifyOptions {
                quick: true,
                ..Default::default()
            },
            skip_decoder: false,
        };
        for pair in query
            .trim_start_matches('?')
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = decode_component(value);
            match key {
                "kernels" => {
                    for name in value.split(',').filter(|n| !n.is_empty()) {
                        s.options
                            .kernels
                            .push(name.parse().map_err(|e: kvattn::Error| e.to_string())?);
                    }
                }
                "precision" => {
                    for name in value.split(',').filter(|n| !n.is_empty()) {
                        s.options.precisions.push(match name {
                            "f32" => Precision::F32,
                            "f16" => Precision::F16,
                            other => return Err(format!("unknown precision {other:?} (f32, f16)")),
                        });
                    }
                }
                "name" => s.options.name_contains = Some(value),
                "full" => s.options.quick = value == "0",
                "decoder" => s.skip_decoder = value == "0",
                other => {
                    return Err(format!(
                        "unknown option {other:?} (kernels, precision, name, full, decoder)"
                    ))
                }
            }
        }
        Ok(s)
    }

    /// The selection in words, for the page.
    pub fn describe(&self) -> String {
        let o = &self.options;
        let mut parts = vec![if o.quick { "quick set" } else { "full grid" }.to_string()];
        if !o.kernels.is_empty() {
            let names: Vec<&str> = o.kernels.iter().map(|k| k.name()).collect();
            parts.push(format!("kernels {}", names.join(", ")));
        }
        if !o.precisions.is_empty() {
            let names: Vec<&str> = o.precisions.iter().map(|p| p.name()).collect();
            parts.push(format!("precision {}", names.join(", ")));
        }
        if let Some(text) = &o.name_contains {
            parts.push(format!("names containing {text:?}"));
        }
        if self.skip_decoder {
            parts.push("no decoder step".into());
        }
        parts.join("; ")
    }
}

/// `%XX` escapes and `+` of a URL query value.
fn decode_component(value: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(h, l)| (h * 16 + l) as u8),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Milliseconds since navigation start (`performance.now()`).
#[cfg(target_arch = "wasm32")]
pub(crate) fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or(0.0, |p| p.now())
}

/// Runs the page: see the module's docs. `query` is `location.search`; `browser_adapter` is
/// the JSON of what the browser says of its adapter (`null` without WebGPU).
#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen]
pub async fn run(query: String, browser_adapter: String) {
    page::run(&query, &browser_adapter).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_selects_the_grid() {
        let s = Selection::parse("").unwrap();
        assert!(s.options.quick && s.options.kernels.is_empty() && !s.skip_decoder);
        let s = Selection::parse("?kernels=paged,decode&precision=f32&name=int8%2Fint4&decoder=0")
            .unwrap();
        assert_eq!(s.options.kernels.len(), 2);
        assert_eq!(s.options.precisions, vec![kvattn::shader::Precision::F32]);
        assert_eq!(s.options.name_contains.as_deref(), Some("int8/int4"));
        assert!(s.skip_decoder);
        assert!(!Selection::parse("?full=1").unwrap().options.quick);
        assert!(Selection::parse("?kernels=nope").is_err());
        assert!(Selection::parse("?colour=blue").is_err());
        assert_eq!(decode_component("a%2"), "a%2");
        assert_eq!(decode_component("%e2%82%ac+x%zz"), "\u{20ac} x%zz");
    }
}
