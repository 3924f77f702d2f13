//! The decoder with its matrices in GGUF block formats on the GPU (a `WeightSource` handing
//! out blocks, as a GGUF file does): every block type in some matrix of a three-layer model,
//! logits against the CPU forward pass on the dequantized weights, and the batch invariance
//! the f32 decoder has (decode steps and a recomputing prefill, alone and batched: same bits).

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::blocks::dequantize;
use kvattn::decoder::gguf::GgmlType;
use kvattn::decoder::model::{Decoder, DecoderConfig, HostLayer, HostWeights};
use kvattn::decoder::toy::toy_config;
use kvattn::decoder::weights::{LayerMatrix, MatrixData, WeightSource};
use kvattn::quant::KvDtype;
use kvattn::reference::llama::llama_logits;
use kvattn::shader::Precision;
use kvattn::Result;

use crate::common::{gpu, max_abs_err, output_scale, Rng};
use crate::gguf_writer::{temp_dir, Blocks, GgufWriter};
use crate::qmatmul::random_weight;

/// A model whose matrices are blocks, and the same model dequantized to f32.
struct BlockModel {
    embedding: Blocks,
    output: Blocks,
    layers: Vec<Vec<Blocks>>,
    f32: HostWeights,
}

/// The type of matrix `which` of layer `layer`: together the layers use every block type
/// (K-quants where the rows are 512 values, a multiple of 256).
fn type_of(layer: usize, which: LayerMatrix) -> GgmlType {
    use GgmlType::*;
    match which {
        LayerMatrix::Q => [Q4_0, Q5_0, Q8_0][layer],
        LayerMatrix::K => [Q5_1, Q4_1, Q4_0][layer],
        LayerMatrix::V => [Q8_0, F16, Q5_1][layer],
        LayerMatrix::O => [Q4_1, Q8_0, BF16][layer],
        LayerMatrix::Gate => [Q5_0, Q4_0, Q8_0][layer],
        LayerMatrix::Up => [F16, BF16, F32][layer],
        LayerMatrix::Down => [Q4_K, Q5_K, Q6_K][layer],
    }
}

fn config() -> DecoderConfig {
    DecoderConfig {
        layers: 3,
        ..toy_config(2)
    }
}

fn block_model(c: &DecoderConfig, seed: u64) -> BlockModel {
    block_model_of(c, seed, type_of)
}

/// A model whose matrix `which` of layer `layer` has type `type_of(layer, which)`.
fn block_model_of(
    c: &DecoderConfig,
    seed: u64,
    type_of: fn(usize, LayerMatrix) -> GgmlType,
) -> BlockModel {
    let mut rng = Rng::new(seed);
    let mut blocks = |ty: GgmlType, (n, k): (usize, usize)| -> (Blocks, Vec<f32>) {
        let bytes = random_weight(&mut rng, ty, n, k);
        let values = dequantize(ty, &bytes, n * k).unwrap();
        ((ty, bytes), values)
    };
    let d = c.d_model;
    let (embedding, embed) = blocks(GgmlType::Q8_0, (c.vocab, d));
    let (output, lm_head) = blocks(GgmlType::Q4_1, (c.vocab, d));
    let mut layers = Vec::new();
    let mut host = Vec::new();
    for layer in 0..c.layers {
        let mut m = Vec::new();
        let mut f = Vec::new();
        for which in LayerMatrix::ALL {
            let (b, v) = blocks(type_of(layer, which), which.shape(c));
            m.push(b);
            f.push(v);
        }
        let mut f = f.into_iter();
        let mut next = || f.next().unwrap();
        host.push(HostLayer {
            attn_norm: vec![1.0; d],
            wq: next(),
            wk: next(),
            wv: next(),
            wo: next(),
            bq: None,
            bk: None,
            bv: None,
            ffn_norm: vec![1.0; d],
            w_gate: next(),
            w_up: next(),
            w_down: next(),
        });
        layers.push(m);
    }
    BlockModel {
        embedding,
        output,
        layers,
        f32: HostWeights {
            embed,
            layers: host,
            final_norm: vec![1.0; d],
            lm_head: Some(lm_head),
            rope_freqs: None,
        },
    }
}

fn blocks_of((ty, bytes): &Blocks) -> MatrixData<'_> {
    MatrixData::Blocks { ty: *ty, bytes }
}

impl WeightSource for BlockModel {
    fn embedding(&self) -> Result<MatrixData<'_>> {
        Ok(blocks_of(&self.embedding))
    }

    fn output(&self) -> Result<Option<MatrixData<'_>>> {
        Ok(Some(blocks_of(&self.output)))
    }

    fn final_norm(&self) -> Result<Vec<f32>> {
        Ok(self.f32.final_norm.clone())
    }

    fn norms(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = &self.f32.layers[layer];
        Ok((l.attn_norm.clone(), l.ffn_norm.clone()))
    }

    fn matrix(&self, layer: usize, which: LayerMatrix) -> Result<MatrixData<'_>> {
        Ok(blocks_of(&self.layers[layer][which.index()]))
    }
}

/// `n` random token ids below `vocab`.
pub(crate) fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

#[test]
fn block_weights_match_the_cpu_forward_pass_and_stay_in_their_format() {
    let ctx = gpu();
    let c = config();
    let m = block_model(&c, 41);
    let model = Decoder::upload_from(ctx, c, &m, Precision::F32, |_, _| {}).unwrap();
    // The bytes on the GPU: the blocks (with their padding) and the f32 norms.
    let file: usize = m.layers.iter().flatten().map(|b| b.1.len()).sum::<usize>()
        + m.embedding.1.len()
        + m.output.1.len();
    let norms = (2 * c.layers + 1) * c.d_model * 4;
    let gpu_bytes = model.weight_bytes() as usize;
    assert!(
        gpu_bytes >= file + norms && gpu_bytes as f64 <= (file + norms) as f64 * 1.15,
        "{gpu_bytes} bytes on the GPU for {file} bytes of blocks and {norms} of norms"
    );
    let f32_model = Decoder::upload(ctx, c, &m.f32, Precision::F32).unwrap();
    let f32_bytes = f32_model.weight_bytes() as usize;
    assert!(
        f32_bytes > 2 * gpu_bytes,
        "{f32_bytes} bytes in f32 against {gpu_bytes} in blocks"
    );
    let mut cache =
        PagedKvCache::new(ctx, c.kv_config(KvDtype::F32), PoolSize::Blocks(16)).unwrap();
    cache.add_sequence(0, &[]).unwrap();
    let ids = tokens(19, c.vocab, 3);
    let mut upto = 16;
    let mut got = model
        .forward(ctx, &mut cache, &[(0, &ids[..upto])])
        .unwrap();
    loop {
        let want = llama_logits(&c, &m.f32, &ids[..upto], None).unwrap();
        let err = max_abs_err(&got.logits, &want);
        let bound = 1e-4 * output_scale(&want);
        assert!(
            err <= bound,
            "{upto} tokens: logit error {err:e} > {bound:e}"
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

#[test]
fn block_weights_keep_decode_prefill_and_batch_bits() {
    let ctx = gpu();
    let c = config();
    let m = block_model(&c, 43);
    let model = Decoder::upload_from(ctx, c, &m, Precision::F32, |_, _| {}).unwrap();
    // Decode steps (one-row products) against a recomputing prefill (products of 21 rows).
    assert_decode_prefill_and_batch_bits(&model, &c, &tokens(21, c.vocab, 6), 9);
}

/// Q, K and V of one type, each at least one window of the row kernel (64 KiB): on a CPU
/// adapter a decode step takes them in one grouped product (`qmatmul_group`) and a prefill in
/// three; the decode steps and the prefill still give the same bits.
#[test]
fn grouped_qkv_products_keep_decode_prefill_and_batch_bits() {
    use kvattn::decoder::ops::qmatmul::{input_buffer, QWeight};
    use kvattn::decoder::ops::qmatmul_group::{can_group, GroupOutput};
    let ctx = gpu();
    let c = DecoderConfig {
        d_model: 512,
        head_dim: 64,
        ..config()
    };
    let m = block_model_of(&c, 47, |_, which| match which {
        LayerMatrix::Q | LayerMatrix::K | LayerMatrix::V => GgmlType::Q8_0,
        _ => GgmlType::Q4_0,
    });
    // The layer's Q, K and V are what the row kernel groups, on CPU adapters.
    let x = input_buffer(ctx, "x", &vec![0.0; c.d_model]).unwrap();
    let ws: Vec<QWeight> = [LayerMatrix::Q, LayerMatrix::K, LayerMatrix::V]
        .into_iter()
        .map(|which| {
            let (ty, bytes) = &m.layers[0][which.index()];
            QWeight::upload(ctx, "w", *ty, which.shape(&c), bytes).unwrap()
        })
        .collect();
    let ys: Vec<wgpu::Buffer> = ws
        .iter()
        .map(|w| ctx.filled("y", w.shape().0, 0.0f32).unwrap())
        .collect();
    let outputs: Vec<GroupOutput> = ws
        .iter()
        .zip(&ys)
        .map(|(w, y)| GroupOutput { w, y })
        .collect();
    assert_eq!(can_group(ctx, &x, 0, &outputs), ctx.caps().cpu_adapter);
    let model = Decoder::upload_from(ctx, c, &m, Precision::F32, |_, _| {}).unwrap();
    assert_decode_prefill_and_batch_bits(&model, &c, &tokens(21, c.vocab, 6), 9);
}

/// Decode steps from token `prefix` on against one recomputing prefill of `ids`: the same last
/// logits and the same K/V bits in every layer; then another sequence's prefill alone and
/// batched with a decode step: the same logits.
pub(crate) fn assert_decode_prefill_and_batch_bits(
    model: &Decoder,
    c: &DecoderConfig,
    ids: &[u32],
    prefix: usize,
) {
    let ctx = gpu();
    let other = tokens(7, c.vocab, 7);
    let new_cache = || {
        let mut kv = c.kv_config(KvDtype::F16);
        kv.block_size = 8;
        let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(16)).unwrap();
        for s in 0..3 {
            cache.add_sequence(s, &[]).unwrap();
        }
        cache
    };
    let mut cache = new_cache();
    model
        .forward(ctx, &mut cache, &[(0, &ids[..prefix])])
        .unwrap();
    let mut last = None;
    for i in prefix..ids.len() {
        last = Some(
            model
                .forward(ctx, &mut cache, &[(0, &ids[i..i + 1])])
                .unwrap(),
        );
    }
    let whole = model.forward(ctx, &mut cache, &[(1, ids)]).unwrap();
    assert_eq!(
        last.unwrap().logits,
        whole.logits,
        "decode steps vs prefill logits"
    );
    for layer in 0..c.layers {
        let (a, b) = (
            cache.read_rows(ctx, 0, layer).unwrap(),
            cache.read_rows(ctx, 1, layer).unwrap(),
        );
        assert_eq!(a, b, "layer {layer} K/V");
    }
    // Another sequence's prefill batched with a step of sequence 1.
    let batched = model
        .forward(ctx, &mut cache, &[(2, &other), (1, &ids[..1])])
        .unwrap();
    let mut alone_cache = new_cache();
    let alone = model
        .forward(ctx, &mut alone_cache, &[(2, &other)])
        .unwrap();
    assert_eq!(alone.logits, batched.logits[..c.vocab], "alone vs batched");
}

/// A GGUF version 3 file holding `m` as a `llama` model of shape `c`: the metadata
/// `LlamaHyper` reads and every tensor, blocks as they are, norms as F32.
fn gguf_file(c: &DecoderConfig, m: &BlockModel) -> Vec<u8> {
    let mut w = GgufWriter::default();
    w.hyper("llama", c).model(c, &m.f32, |which, output| {
        Some(match which {
            Some((layer, which)) => m.layers[layer][which.index()].clone(),
            None if output => m.output.clone(),
            None => m.embedding.clone(),
        })
    });
    w.build()
}

/// The model written as a GGUF file, mapped and uploaded as `load_gguf` does (`GgufSource`):
/// the very bits of the same blocks handed over in memory.
#[test]
fn a_gguf_file_of_block_tensors_loads_with_the_bits_of_its_blocks() {
    use kvattn::decoder::gguf::{GgufFile, LlamaHyper};
    use kvattn::decoder::load::{decoder_config, GgufSource};
    let ctx = gpu();
    let c = config();
    let m = block_model(&c, 47);
    let dir = temp_dir("blocks");
    let path = dir.join("blocks.gguf");
    std::fs::write(&path, gguf_file(&c, &m)).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let hyper = LlamaHyper::from_gguf(&file).unwrap();
    let config = decoder_config(&hyper).unwrap();
    assert_eq!(
        (config.layers, config.d_model, config.vocab),
        (c.layers, c.d_model, c.vocab)
    );
    let source = GgufSource::new(&file, &hyper).unwrap();
    let mut ticks = 0;
    let from_file =
        Decoder::upload_from(ctx, config, &source, Precision::F32, |_, _| ticks += 1).unwrap();
    assert_eq!(ticks, 3 + 9 * c.layers);
    let in_memory = Decoder::upload_from(ctx, config, &m, Precision::F32, |_, _| {}).unwrap();
    assert_eq!(from_file.weight_bytes(), in_memory.weight_bytes());
    let ids = tokens(11, c.vocab, 9);
    let mut logits = Vec::new();
    for model in [&from_file, &in_memory] {
        let mut cache =
            PagedKvCache::new(ctx, config.kv_config(KvDtype::F16), PoolSize::Blocks(8)).unwrap();
        cache.add_sequence(0, &[]).unwrap();
        logits.push(model.forward(ctx, &mut cache, &[(0, &ids)]).unwrap().logits);
    }
    assert_eq!(logits[0], logits[1]);
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
}
