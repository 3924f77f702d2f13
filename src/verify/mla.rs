//! The `mla` rows of `kvattn verify`: both MLA paths over a latent paged cache (free blocks
//! shuffled) against the f64 reference in its absorbed form, on the latent as the cache stores
//! it (encoded and decoded by the CPU codec; the RoPE keys rounded to their 16-bit format).
//!
//! Tolerances: f32 kernels within `1e-4` of the output scale (lse `1e-4` of its scale); the f16
//! kernel holds the queries, the latent rows and the probabilities in f16, and must stay within
//! `1/128` of the output scale (lse likewise), the bound the GPU tests use.

use crate::attention::paged::PagedQuery;
use crate::cache::paged::PoolSize;
use crate::cache::scales::CacheScales;
use crate::gpu::Context;
use crate::mla::{mla_host_async, MlaArgs, MlaCache, MlaCacheConfig, MlaPath, MlaWeights};
use crate::quant::{decode_rows, encode_rows, per_tensor_scale, KvDtype, ScaleMode};
use crate::reference::mla::{mla, MlaBatch, MlaShape};
use crate::shader::Precision;
use crate::Result;

use super::cases::lens_name;
use super::clock::Stopwatch;
use super::metrics::{Outcome, Rng};
use super::verifier::{perturb, Phases};

/// One MLA check: shape, sequences `(len_q, len_k)`, latent storage, path, kernel variant.
#[derive(Debug, Clone)]
pub(crate) struct MlaCheck {
    pub shape: MlaShape,
    pub lens: Vec<(usize, usize)>,
    pub latent: KvDtype,
    /// A per-tensor FP8 latent scale calibrated on the data (else per row).
    pub per_tensor: bool,
    pub path: MlaPath,
    pub precision: Precision,
    pub block_size: usize,
}

impl MlaCheck {
    /// The latent storage, e.g. `fp8-e4m3/tensor`.
    pub fn storage(&self) -> String {
        if self.per_tensor {
            format!("{}/tensor", self.latent)
        } else {
            self.latent.to_string()
        }
    }

    /// The row's case name.
    pub fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "{} h{} nope{} rope{} rank{} v{} latent-{} {} bs{} q/k {}",
            self.path.name(),
            s.num_heads,
            s.d_nope,
            s.d_rope,
            s.rank,
            s.d_v,
            self.storage(),
            self.precision.name(),
            self.block_size,
            lens_name(&self.lens)
        )
    }

    /// Runs the check on `ctx` with data from `seed`, timing its GPU side and its oracle in
    /// `phases`; `corrupt` perturbs the output before it is judged (a test hook).
    pub async fn run(
        &self,
        ctx: &Context,
        seed: u64,
        phases: &mut Phases,
        corrupt: bool,
    ) -> Result<Outcome> {
        let s = self.shape;
        let h = s.num_heads;
        let mut rng = Rng::new(seed);
        let total_q: usize = self.lens.iter().map(|l| l.0).sum();
        let total_k: usize = self.lens.iter().map(|l| l.1).sum();
        let c_kv = rng.normals(total_k * s.rank, 1.0);
        let k_pe = rng.normals(total_k * s.d_rope, 1.0);
        let q_nope = rng.normals(total_q * h * s.d_nope, 1.0);
        let q_pe = rng.normals(total_q * h * s.d_rope, 1.0);
        let w_uk = rng.normals(h * s.d_nope * s.rank, 1.0 / (s.d_nope as f32).sqrt());
        let w_uv = rng.normals(h * s.rank * s.d_v, 1.0 / (s.rank as f32).sqrt());

        let gpu = Stopwatch::start();
        let mut config = MlaCacheConfig::new(1, s.rank, s.d_rope, self.latent);
        config.block_size = self.block_size;
        config.prefix_caching = false;
        let mode = if self.per_tensor {
            let x = per_tensor_scale(self.latent, &c_kv, 1.25)?;
            config.latent_scales = CacheScales::PerTensor(vec![x]);
            ScaleMode::PerTensor(x)
        } else {
            ScaleMode::PerRow
        };
        let rope = config.rope_dtype;
        let blocks: usize = self
            .lens
            .iter()
            .map(|l| l.1.div_ceil(self.block_size))
            .sum();
        let mut cache = MlaCache::new(ctx, config, PoolSize::Blocks(2 * blocks + 1))?;
        cache.cache_mut().shuffle_free_blocks(seed);
        let mut batch = Vec::new();
        let mut k0 = 0;
        for (i, &(len_q, len_k)) in self.lens.iter().enumerate() {
            let seq = i as u64;
            cache.cache_mut().add_sequence(seq, &[])?;
            let tokens: Vec<u32> = (0..len_k as u32).collect();
            let c = c_kv[k0 * s.rank..(k0 + len_k) * s.rank].to_vec();
            let p = k_pe[k0 * s.d_rope..(k0 + len_k) * s.d_rope].to_vec();
            cache.append_host(ctx, seq, &tokens, &[c], &[p])?;
            batch.push(PagedQuery { seq, len_q });
            k0 += len_k;
        }
        let weights = MlaWeights::upload(ctx, &s, &w_uk, &w_uv)?;
        let args = MlaArgs {
            layer: 0,
            batch: &batch,
            shape: s,
            scale: None,
            precision: self.precision,
            path: self.path,
            up_proj_chunk: None,
        };
        let result = mla_host_async(ctx, &cache, &weights, &args, &q_nope, &q_pe).await;
        phases.gpu += gpu.seconds();
        let mut got = match result {
            Ok(got) => got,
            Err(e) => return Ok(Outcome::from_error(&e)),
        };
        if corrupt {
            perturb(&mut got.out);
        }
        let reference = Stopwatch::start();

        let stored_c = decode_rows(&encode_rows(self.latent, s.rank, &c_kv, mode)?)?;
        let stored_p = decode_rows(&encode_rows(rope, s.d_rope, &k_pe, ScaleMode::PerRow)?)?;
        let (mut cu_q, mut cu_k) = (vec![0u32], vec![0u32]);
        for &(lq, lk) in &self.lens {
            cu_q.push(cu_q.last().copied().unwrap_or(0) + lq as u32);
            cu_k.push(cu_k.last().copied().unwrap_or(0) + lk as u32);
        }
        let want = mla(
            &MlaBatch {
                q_nope: &q_nope,
                q_pe: &q_pe,
                c_kv: &stored_c,
                k_pe: &stored_p,
                w_uk: &w_uk,
                w_uv: &w_uv,
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
            },
            &s,
            None,
        )?;
        let scale_of = |x: &[f32]| x.iter().map(|v| f64::from(v.abs())).fold(1.0, f64::max);
        let tol = match self.precision {
            Precision::F32 => 1e-4,
            Precision::F16 => 1.0 / 128.0,
        };
        let (bound, lse_bound) = (tol * scale_of(&want.out), tol * scale_of(&want.lse));
        let outcome = Outcome::attention(&got, &want, (bound, lse_bound));
        phases.reference += reference.seconds();
        Ok(outcome)
    }
}

/// The MLA rows of the grid: a small odd shape on both paths in several latent formats (quick),
/// plus DeepSeek-V2's shape and every latent format (full).
pub(crate) fn mla_grid(quick: bool, precisions: &[Precision]) -> Vec<MlaCheck> {
    let small = MlaShape {
        num_heads: 5,
        d_nope: 16,
        d_rope: 8,
        rank: 64,
        d_v: 24,
    };
    let lens = vec![(1, 37), (9, 40), (1, 600)];
    let mut latents = vec![
        (KvDtype::F16, false),
        (KvDtype::Fp8E4M3, true),
        (KvDtype::Int4, false),
    ];
    if !quick {
        latents.extend([
            (KvDtype::F32, false),
            (KvDtype::Bf16, false),
            (KvDtype::Fp8E4M3, false),
            (KvDtype::Fp8E5M2, true),
            (KvDtype::Int8, false),
        ]);
    }
    let mut checks = Vec::new();
    let mut turn = 0;
    for (l, &(latent, per_tensor)) in latents.iter().enumerate() {
        for (p, path) in [MlaPath::Absorbed, MlaPath::UpProj].into_iter().enumerate() {
            // Quick mode: one precision per row, alternating over formats and paths.
            let variants: Vec<Precision> = if quick {
                vec![precisions[(l + p) % precisions.len()]]
            } else {
                precisions.to_vec()
            };
            for precision in variants {
                turn += 1;
                checks.push(MlaCheck {
                    shape: small,
                    lens: lens.clone(),
                    latent,
                    per_tensor,
                    path,
                    precision,
                    block_size: [16, 64, 1][turn % 3],
                });
            }
        }
    }
    if !quick {
        for (latent, per_tensor) in [(KvDtype::F16, false), (KvDtype::Fp8E4M3, true)] {
            for path in [MlaPath::Absorbed, MlaPath::UpProj] {
                for &precision in precisions {
                    checks.push(MlaCheck {
                        shape: MlaShape::DEEPSEEK_V2,
                        lens: vec![(1, 300), (4, 70)],
                        latent,
                        per_tensor,
                        path,
                        precision,
                        block_size: 64,
                    });
                }
            }
        }
    }
    checks
}
