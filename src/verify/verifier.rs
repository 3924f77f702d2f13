//! Runs one case of the grid: the kernel on the adapter, its oracle on the CPU, the comparison.

use std::collections::HashMap;

use crate::attention::decode::{decode_batch_async, DecodeConfig};
use crate::gpu::Context;
use crate::quant::dequant::dequantize_async;
use crate::quant::{decode_rows, encode_rows, KvDtype, ScaleMode};
use crate::reference::{self, AttentionOutput};
use crate::shader::Precision;
use crate::{Error, Result};

use super::append::AppendCase;
use super::cases::{Check, KvFormat, Problem, PAGED_UNIMPLEMENTED};
use super::clock::Stopwatch;
use super::metrics::{exact_outcome, max_abs_err, Outcome, Rng};
use super::oracle::{f16_emulation, seed_of, stored, Oracle, ProblemData};
use super::paged::{check_paged, run_paged_async, PagedSetup};
use super::report::Status;

/// What the verifier keeps across checks: the adapter and, made on first use, a second
/// context whose storage bindings are capped so that pools split over several buffers.
pub(crate) struct Verifier<'a> {
    pub ctx: &'a Context,
    pub capped: Option<Context>,
    /// Oracles by problem and storage format.
    pub oracles: HashMap<String, Oracle>,
    /// Where the current case's time went.
    pub phases: Phases,
    /// Test hook: attention outputs and decoded values are perturbed before they are judged.
    pub corrupt: bool,
}

/// Wall time of the current case's GPU side (compilation included) and of its CPU oracle.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Phases {
    pub gpu: f64,
    pub reference: f64,
}

impl Phases {
    /// Awaits `f`, adding its wall time to the GPU side.
    pub async fn gpu<T>(&mut self, f: impl std::future::Future<Output = T>) -> T {
        let clock = Stopwatch::start();
        let out = f.await;
        self.gpu += clock.seconds();
        out
    }

    /// Runs `f`, adding its wall time to the CPU oracle.
    pub fn reference<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let clock = Stopwatch::start();
        let out = f();
        self.reference += clock.seconds();
        out
    }
}

/// The test hook's perturbation: the first finite value moved by one (so no tolerance and no
/// bit-exact comparison accepts it).
pub(crate) fn perturb(x: &mut [f32]) {
    if let Some(v) = x.iter_mut().find(|v| v.is_finite()) {
        *v += 1.0;
    }
}

impl Verifier<'_> {
    /// Judges an attention output, timed as the CPU oracle (see [`Verifier::judge_attention`]).
    fn judge(
        &mut self,
        got: &AttentionOutput,
        data: &ProblemData,
        problem: &Problem,
        storage: (KvFormat, (ScaleMode, ScaleMode)),
        precision: Precision,
    ) -> Result<Outcome> {
        let clock = Stopwatch::start();
        let mut perturbed;
        let got = if self.corrupt {
            perturbed = got.clone();
            perturb(&mut perturbed.out);
            &perturbed
        } else {
            got
        };
        let outcome = self.judge_attention(got, data, problem, storage, precision);
        self.phases.reference += clock.seconds();
        outcome
    }

    /// Compares an attention kernel's output with the reference on the stored values (K and V
    /// in `format` with scales `modes`, encoded by the CPU codec), with the tolerance of
    /// `precision`.
    fn judge_attention(
        &mut self,
        got: &AttentionOutput,
        data: &ProblemData,
        problem: &Problem,
        (format, modes): (KvFormat, (ScaleMode, ScaleMode)),
        precision: Precision,
    ) -> Result<Outcome> {
        let s = &problem.shape;
        let opts = problem.opts.options(s.num_q_heads);
        let k = stored(format.k, s.head_dim_qk, &data.k, modes.0)?;
        let v = stored(format.v, s.head_dim_v, &data.v, modes.1)?;
        let batch = data.batch(&k, &v);
        let key = format!("{problem:?} {format}");
        if !self.oracles.contains_key(&key) {
            let want = reference::attention(&batch, s, &opts)?;
            self.oracles.insert(key.clone(), Oracle { want, f16: None });
        }
        let oracle = self.oracles.get_mut(&key).expect("inserted above");
        if precision == Precision::F16 && oracle.f16.is_none() {
            oracle.f16 = Some(f16_emulation(&batch, s, &opts));
        }
        let want = &oracle.want;
        let scale = want
            .out
            .iter()
            .filter(|x| x.is_finite())
            .map(|x| f64::from(x.abs()))
            .fold(1.0, f64::max);
        let (bound, lse_bound) = match (precision, &oracle.f16) {
            (Precision::F16, Some(emu)) => (
                2.0 * max_abs_err(&emu.out, &want.out) + 1e-5 * scale,
                2.0 * max_abs_err(&emu.lse, &want.lse) + 1e-5,
            ),
            _ => (1e-4 * scale, 1e-4),
        };
        Ok(Outcome::attention(got, want, (bound, lse_bound)))
    }

    pub async fn run(&mut self, check: &Check, seed: u64) -> Result<Outcome> {
        match check {
            Check::Decode {
                problem,
                dtype,
                precision,
            } => {
                let data = ProblemData::new(problem, seed_of(&format!("{problem:?}")));
                let opts = problem.opts.options(problem.shape.num_q_heads);
                let config = DecodeConfig {
                    k_dtype: *dtype,
                    v_dtype: *dtype,
                    precision: *precision,
                };
                let batch = data.batch(&data.k, &data.v);
                let storage = (
                    KvFormat::same(*dtype),
                    (ScaleMode::PerRow, ScaleMode::PerRow),
                );
                let ctx = self.ctx;
                let result = self
                    .phases
                    .gpu(decode_batch_async(
                        ctx,
                        &batch,
                        &problem.shape,
                        &opts,
                        &config,
                    ))
                    .await;
                match result {
                    Ok(got) => self.judge(&got, &data, problem, storage, *precision),
                    Err(e) => Ok(Outcome::from_error(&e)),
                }
            }
            Check::Paged {
                problem,
                format,
                precision,
                block_size,
            } => {
                let data = ProblemData::new(problem, seed_of(&format!("{problem:?}")));
                let opts = problem.opts.options(problem.shape.num_q_heads);
                let modes = format.modes(&data.k, &data.v)?;
                let tensor_scale = |m: ScaleMode| match m {
                    ScaleMode::PerTensor(s) => Some(s),
                    ScaleMode::PerRow => None,
                };
                let setup = PagedSetup {
                    k_dtype: format.k,
                    v_dtype: format.v,
                    k_scale: tensor_scale(modes.0),
                    v_scale: tensor_scale(modes.1),
                    block_size: *block_size,
                    precision: *precision,
                    seed,
                };
                let batch = data.batch(&data.k, &data.v);
                let ctx = self.ctx;
                let result = self
                    .phases
                    .gpu(async {
                        check_paged(&batch, &problem.shape, &opts, &setup)?;
                        run_paged_async(ctx, &batch, &problem.shape, &opts, &setup).await
                    })
                    .await;
                let storage = (*format, modes);
                match result {
                    Ok(got) => self.judge(&got, &data, problem, storage, *precision),
                    Err(Error::InvalidArgument(m)) if m == PAGED_UNIMPLEMENTED => {
                        Ok(Outcome::unmeasured(Status::Unavailable, m))
                    }
                    Err(e) => Ok(Outcome::from_error(&e)),
                }
            }
            Check::Dequant {
                dtype,
                head_dim,
                per_tensor,
            } => self.dequant(*dtype, *head_dim, *per_tensor, seed).await,
            Check::AppendKv {
                dtype,
                head_dim,
                block_size,
                src,
                per_tensor,
            } => {
                self.append_kv(
                    AppendCase {
                        dtype: *dtype,
                        d: *head_dim,
                        block_size: *block_size,
                        src: *src,
                        per_tensor: *per_tensor,
                    },
                    seed,
                )
                .await
            }
            Check::Mla(m) => m.run(self.ctx, seed, &mut self.phases, self.corrupt).await,
        }
    }

    /// GPU decoders against the CPU codec on 3 x 37 rows with an outlier per row.
    async fn dequant(
        &mut self,
        dtype: KvDtype,
        d: usize,
        per_tensor: bool,
        seed: u64,
    ) -> Result<Outcome> {
        let rows = 3 * 37;
        let mut x = Rng::new(seed).normals(rows * d, 2.0);
        for (r, row) in x.chunks_mut(d).enumerate() {
            row[r % d] *= 40.0;
        }
        let mode = match dtype.fp8_format() {
            Some(fmt) if per_tensor => {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                ScaleMode::PerTensor(amax / fmt.max_value())
            }
            _ => ScaleMode::PerRow,
        };
        let (rows, want) = self.phases.reference(|| -> Result<_> {
            let rows = encode_rows(dtype, d, &x, mode)?;
            let want = decode_rows(&rows)?;
            Ok((rows, want))
        })?;
        let ctx = self.ctx;
        match self.phases.gpu(dequantize_async(ctx, &rows)).await {
            Ok(mut got) => {
                if self.corrupt {
                    perturb(&mut got);
                }
                Ok(exact_outcome(&got, &want))
            }
            Err(e) => Ok(Outcome::from_error(&e)),
        }
    }
}
