//! Small synthetic models of each architecture the GGUF loader takes, written as GGUF files by
//! the test (random weights, odd sizes, GQA, a head dim set by `attention.key_length`), loaded
//! through the real path (`GgufFile::open`, `LlamaHyper::from_gguf`, `decoder_config`,
//! `GgufSource`, `Decoder::upload_from`) and run on the GPU against `reference::llama` on the
//! same weights: `llama` with a separate output projection, `llama` with the optional Q/K/V
//! biases and tied embeddings, `llama` with RoPE frequency factors (Llama 3.1's
//! `rope_freqs.weight`), `qwen2` (Q/K/V biases, tied embeddings, NeoX RoPE). The qwen2 model
//! also keeps the decoder's batch invariance bit for bit.

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::gguf::{GgufFile, LlamaHyper};
use kvattn::decoder::load::{decoder_config, host_weights, GgufSource};
use kvattn::decoder::model::{Decoder, DecoderConfig, HostLayer, HostWeights};
use kvattn::decoder::weights::LayerMatrix;
use kvattn::quant::KvDtype;
use kvattn::reference::llama::llama_logits;
use kvattn::rope::RopeStyle;
use kvattn::shader::Precision;

use crate::common::{gpu, max_abs_err, output_scale, Rng};
use crate::decoder_blocks::{assert_decode_prefill_and_batch_bits, tokens as random_tokens};
use crate::gguf_writer::{f32_blocks, temp_dir, GgufWriter};

/// The shape of the synthetic models: 6 query heads on 2 KV heads of 12 dims (72 wide) on a
/// residual of 80, an MLP of 96, a vocabulary of 75. The RoPE base and epsilon are Qwen2.5's.
fn shape(style: RopeStyle) -> DecoderConfig {
    DecoderConfig {
        layers: 2,
        d_model: 80,
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 12,
        ffn: 96,
        vocab: 75,
        rope_theta: 1_000_000.0,
        rope_style: style,
        rms_eps: 1e-6,
    }
}

/// What a synthetic model has besides the Llama weights.
#[derive(Debug, Clone, Copy)]
struct Extras {
    /// Q/K/V biases (scale 0.5).
    biases: bool,
    /// The output projection is the embedding.
    tied: bool,
    /// RoPE frequency factors (Llama 3.1's shape: 1 for the fast pairs up to 8 for the slow).
    rope_freqs: bool,
}

/// Seeded random weights for `c` (matrices scaled by `1 / sqrt(fan_in)`, norms near 1) with
/// the extras `e`.
fn weights(c: &DecoderConfig, seed: u64, e: Extras) -> HostWeights {
    let Extras {
        biases,
        tied,
        rope_freqs,
    } = e;
    let mut r = Rng::new(seed);
    let d = c.d_model;
    let fan = |n: usize| 1.0 / (n as f32).sqrt();
    let norm = |r: &mut Rng| -> Vec<f32> { r.normals(d, 0.1).iter().map(|x| 1.0 + x).collect() };
    let bias = |r: &mut Rng, n: usize| biases.then(|| r.normals(n, 0.5));
    let layers = (0..c.layers)
        .map(|_| HostLayer {
            attn_norm: norm(&mut r),
            wq: r.normals(c.q_dim() * d, fan(d)),
            wk: r.normals(c.kv_dim() * d, fan(d)),
            wv: r.normals(c.kv_dim() * d, fan(d)),
            wo: r.normals(d * c.q_dim(), fan(c.q_dim())),
            bq: bias(&mut r, c.q_dim()),
            bk: bias(&mut r, c.kv_dim()),
            bv: bias(&mut r, c.kv_dim()),
            ffn_norm: norm(&mut r),
            w_gate: r.normals(c.ffn * d, fan(d)),
            w_up: r.normals(c.ffn * d, fan(d)),
            w_down: r.normals(d * c.ffn, fan(c.ffn)),
        })
        .collect();
    HostWeights {
        embed: r.normals(c.vocab * d, 1.0),
        layers,
        final_norm: norm(&mut r),
        lm_head: (!tied).then(|| r.normals(c.vocab * d, fan(d))),
        rope_freqs: rope_freqs.then(|| {
            let pairs = c.head_dim / 2;
            (0..pairs)
                .map(|i| 1.0 + 7.0 * (i as f32 / (pairs - 1) as f32).powi(2))
                .collect()
        }),
    }
}

/// `w` as a GGUF file of architecture `arch`: every tensor F32 (matrices whose rows are a
/// multiple of 32 values then go to the block-format product, the others to the dense one).
fn gguf_file(arch: &str, c: &DecoderConfig, w: &HostWeights) -> Vec<u8> {
    file_of(GgufWriter::default(), arch, c, w)
}

/// [`gguf_file`] after the metadata already in `g`.
fn file_of(mut g: GgufWriter, arch: &str, c: &DecoderConfig, w: &HostWeights) -> Vec<u8> {
    g.hyper(arch, c).model(c, w, |which, output| match which {
        Some((layer, which)) => {
            let l = &w.layers[layer];
            let m = match which {
                LayerMatrix::Q => &l.wq,
                LayerMatrix::K => &l.wk,
                LayerMatrix::V => &l.wv,
                LayerMatrix::O => &l.wo,
                LayerMatrix::Gate => &l.w_gate,
                LayerMatrix::Up => &l.w_up,
                LayerMatrix::Down => &l.w_down,
            };
            Some(f32_blocks(m))
        }
        None if output => w.lm_head.as_deref().map(f32_blocks),
        None => Some(f32_blocks(&w.embed)),
    });
    g.build()
}

/// A model of architecture `arch` written, mapped and loaded as `load_gguf` does: the
/// decoder, its configuration and the weights the file holds (read back by `host_weights`).
fn load(
    arch: &str,
    c: &DecoderConfig,
    w: &HostWeights,
    tag: &str,
) -> (Decoder, DecoderConfig, HostWeights, LlamaHyper) {
    let ctx = gpu();
    let dir = temp_dir(tag);
    let path = dir.join("model.gguf");
    std::fs::write(&path, gguf_file(arch, c, w)).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let hyper = LlamaHyper::from_gguf(&file).unwrap();
    let config = decoder_config(&hyper).unwrap();
    let (host_config, host) = host_weights(&file, &hyper, None, |_, _| {}).unwrap();
    assert_eq!(host_config, config);
    let source = GgufSource::new(&file, &hyper).unwrap();
    let mut ticks = 0;
    let model =
        Decoder::upload_from(ctx, config, &source, Precision::F32, |_, _| ticks += 1).unwrap();
    assert_eq!(ticks, 3 + 9 * c.layers);
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
    (model, config, host, hyper)
}

/// Each architecture: the file's hyper-parameters and weights are the ones written, and a
/// 13-token prefill then four decode steps give the reference's logits within 1e-4 of their
/// scale (the tolerance of the f32 decoder against the f64-accumulating reference).
#[test]
fn llama_and_qwen2_files_match_the_cpu_forward_pass() {
    let ctx = gpu();
    let e = |biases, tied, rope_freqs| Extras {
        biases,
        tied,
        rope_freqs,
    };
    for (i, (arch, x, style)) in [
        ("llama", e(false, false, false), RopeStyle::GptJ),
        ("llama", e(true, true, false), RopeStyle::GptJ),
        ("llama", e(false, false, true), RopeStyle::GptJ),
        ("qwen2", e(true, true, false), RopeStyle::NeoX),
    ]
    .into_iter()
    .enumerate()
    {
        let c = shape(style);
        let w = weights(&c, 101 + i as u64, x);
        let (model, config, host, hyper) = load(arch, &c, &w, &format!("arch-{i}"));
        assert_eq!(config, c, "{arch}");
        assert_eq!(host, w, "{arch}: the weights read back");
        assert_eq!(
            (
                hyper.architecture.as_str(),
                hyper.qkv_bias,
                hyper.tied_embeddings,
                hyper.rope_freqs
            ),
            (arch, x.biases, x.tied, x.rope_freqs)
        );
        let mut cache =
            PagedKvCache::new(ctx, c.kv_config(KvDtype::F32), PoolSize::Blocks(16)).unwrap();
        cache.add_sequence(0, &[]).unwrap();
        let ids = random_tokens(17, c.vocab, 5);
        let mut upto = 13;
        let mut got = model
            .forward(ctx, &mut cache, &[(0, &ids[..upto])])
            .unwrap();
        loop {
            let want = llama_logits(&c, &w, &ids[..upto], None).unwrap();
            let err = max_abs_err(&got.logits, &want);
            let bound = 1e-4 * output_scale(&want);
            assert!(
                err <= bound,
                "{arch} {x:?}, {upto} tokens: logit error {err:e} > {bound:e}"
            );
            if upto == ids.len() {
                break;
            }
            got = model
                .forward(ctx, &mut cache, &[(0, &ids[upto..upto + 1])])
                .unwrap();
            upto += 1;
        }
    }
}

/// `load_gguf` itself (the loader the example and the CLI call) on a qwen2 file with a minimal
/// byte-level BPE tokenizer in its metadata (one token per vocabulary entry, no merges): the
/// hyper-parameters, the tokenizer's size and the logits of a prefill against the reference.
#[test]
fn load_gguf_takes_a_qwen2_file() {
    use kvattn::decoder::load::load_gguf;
    let ctx = gpu();
    let c = shape(RopeStyle::NeoX);
    let w = weights(
        &c,
        17,
        Extras {
            biases: true,
            tied: true,
            rope_freqs: false,
        },
    );
    let mut g = GgufWriter::default();
    let tokens: Vec<String> = (0..c.vocab).map(|i| format!("t{i}")).collect();
    g.str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "gpt2")
        .str_array("tokenizer.ggml.tokens", &tokens)
        .str_array("tokenizer.ggml.merges", &[]);
    let dir = temp_dir("arch-load");
    let path = dir.join("qwen2.gguf");
    std::fs::write(&path, file_of(g, "qwen2", &c, &w)).unwrap();
    let mut ticks = 0;
    let loaded = load_gguf(ctx, &path, Precision::F32, |_, _| ticks += 1).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(ticks, 3 + 9 * c.layers);
    assert_eq!(loaded.hyper.architecture, "qwen2");
    assert_eq!(loaded.tokenizer.vocab_size(), c.vocab);
    assert_eq!(*loaded.model.config(), c);
    let mut cache = PagedKvCache::new(ctx, c.kv_config(KvDtype::F32), PoolSize::Blocks(8)).unwrap();
    cache.add_sequence(0, &[]).unwrap();
    let ids = random_tokens(11, c.vocab, 4);
    let got = loaded.model.forward(ctx, &mut cache, &[(0, &ids)]).unwrap();
    let want = llama_logits(&c, &w, &ids, None).unwrap();
    let err = max_abs_err(&got.logits, &want);
    assert!(err <= 1e-4 * output_scale(&want), "logit error {err:e}");
}

/// The biases and the frequency factors matter: the same model without them gives other
/// logits (so the test above would see a decoder that dropped them).
#[test]
fn biases_and_frequency_factors_change_the_logits() {
    let c = shape(RopeStyle::NeoX);
    let w = weights(
        &c,
        7,
        Extras {
            biases: true,
            tied: true,
            rope_freqs: true,
        },
    );
    let mut unbiased = w.clone();
    for l in &mut unbiased.layers {
        (l.bq, l.bk, l.bv) = (None, None, None);
    }
    let unscaled = HostWeights {
        rope_freqs: None,
        ..w.clone()
    };
    let ids = random_tokens(9, c.vocab, 3);
    let a = llama_logits(&c, &w, &ids, None).unwrap();
    for (what, other) in [("biases", &unbiased), ("factors", &unscaled)] {
        let b = llama_logits(&c, other, &ids, None).unwrap();
        let diff = max_abs_err(&a, &b);
        assert!(diff > 0.01 * output_scale(&a), "{what}: {diff:e}");
    }
}

/// The qwen2 model keeps the decoder's bits: decode steps against a recomputing prefill (the
/// same logits and K/V), and a sequence alone against batched with another.
#[test]
fn qwen2_keeps_decode_prefill_and_batch_bits() {
    let c = shape(RopeStyle::NeoX);
    let w = weights(
        &c,
        13,
        Extras {
            biases: true,
            tied: true,
            rope_freqs: false,
        },
    );
    let (model, ..) = load("qwen2", &c, &w, "arch-bits");
    assert_decode_prefill_and_batch_bits(&model, &c, &random_tokens(19, c.vocab, 6), 8);
}

/// A source handing out a bias where the decoder has none (after the output product) or of
/// the wrong length: refused, naming the matrix.
#[test]
fn a_bias_the_decoder_cannot_add_is_refused() {
    use kvattn::decoder::weights::{MatrixData, WeightSource};
    struct Odd(HostWeights, LayerMatrix, usize);
    impl WeightSource for Odd {
        fn embedding(&self) -> kvattn::Result<MatrixData<'_>> {
            self.0.embedding()
        }
        fn output(&self) -> kvattn::Result<Option<MatrixData<'_>>> {
            self.0.output()
        }
        fn final_norm(&self) -> kvattn::Result<Vec<f32>> {
            self.0.final_norm()
        }
        fn norms(&self, layer: usize) -> kvattn::Result<(Vec<f32>, Vec<f32>)> {
            self.0.norms(layer)
        }
        fn matrix(&self, layer: usize, which: LayerMatrix) -> kvattn::Result<MatrixData<'_>> {
            self.0.matrix(layer, which)
        }
        fn bias(&self, _: usize, which: LayerMatrix) -> kvattn::Result<Option<Vec<f32>>> {
            Ok((which == self.1).then(|| vec![0.0; self.2]))
        }
    }
    let c = shape(RopeStyle::NeoX);
    let w = weights(
        &c,
        19,
        Extras {
            biases: false,
            tied: true,
            rope_freqs: false,
        },
    );
    for (which, len, name) in [
        (LayerMatrix::O, c.d_model, "attn_output"),
        (LayerMatrix::K, c.kv_dim() + 1, "attn_k bias"),
    ] {
        let source = Odd(w.clone(), which, len);
        match Decoder::upload_from(gpu(), c, &source, Precision::F32, |_, _| {}) {
            Err(kvattn::Error::InvalidArgument(m)) => assert!(m.contains(name), "{m}"),
            other => panic!("{which:?}: {other:?}"),
        }
    }
}
