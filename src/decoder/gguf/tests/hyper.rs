//! Tests of the Llama hyper-parameters: reading and checking them, the tensor table they
//! expect (biases, RoPE frequency factors), and what is refused by name.

use super::Writer;
use crate::decoder::gguf::{GgmlType, GgufFile, LlamaHyper};
use crate::rope::RopeStyle;

fn llama_file(extra: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer::new();
    w.str("general.architecture", "llama")
        .u32("llama.block_count", 2)
        .u32("llama.embedding_length", 64)
        .u32("llama.feed_forward_length", 128)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2)
        .u32("llama.context_length", 256)
        .u32("llama.vocab_size", 10)
        .f32("llama.rope.freq_base", 100000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    extra(&mut w);
    w.build()
}

#[test]
fn llama_hyper() {
    let f = GgufFile::parse(llama_file(|_| {})).unwrap();
    let h = LlamaHyper::from_gguf(&f).unwrap();
    assert_eq!(
        h,
        LlamaHyper {
            architecture: "llama".into(),
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rope_dim: 16,
            ffn_dim: 128,
            rope_base: 100000.0,
            rms_eps: 1e-5,
            vocab_size: 10,
            context_length: 256,
            tied_embeddings: true,
            qkv_bias: false,
            rope_freqs: false,
        }
    );
    assert_eq!(h.rope_style(), RopeStyle::GptJ);
    let names = h.expected_tensors();
    assert_eq!(names.len(), 2 + 2 * 9);
    assert!(h
        .check_tensors(&f)
        .unwrap_err()
        .to_string()
        .contains("token_embd.weight"));
    // Every tensor present: accepted; one of a type kvattn does not read: refused, named.
    let with_tensors = |odd: Option<&str>| {
        let bytes = llama_file(|w| {
            for (name, dims) in h.expected_tensors() {
                let n = dims.iter().product::<u64>() as usize;
                if odd == Some(name.as_str()) {
                    w.tensor(&name, &dims, GgmlType::IQ4_NL, vec![0; n / 32 * 18]);
                } else {
                    w.tensor(&name, &dims, GgmlType::F32, vec![0; n * 4]);
                }
            }
        });
        GgufFile::parse(bytes).unwrap()
    };
    h.check_tensors(&with_tensors(None)).unwrap();
    let e = h
        .check_tensors(&with_tensors(Some("blk.1.ffn_up.weight")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.1.ffn_up.weight") && e.contains("IQ4_NL"),
        "{e}"
    );
    let bad = |extra: fn(&mut Writer), what: &str| {
        let f = GgufFile::parse(llama_file(extra)).unwrap();
        let e = LlamaHyper::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    };
    bad(
        |w| {
            w.u32("llama.rope.dimension_count", 18);
        },
        "dimension_count",
    );
    bad(
        |w| {
            w.u32("llama.attention.key_length", 0);
        },
        "key_length",
    );
    bad(
        |w| {
            w.tensor(
                "token_embd.weight",
                &[64, 9],
                GgmlType::F32,
                vec![0; 64 * 9 * 4],
            );
        },
        "token_embd",
    );
    let mut w = Writer::new();
    w.str("general.architecture", "gptneox");
    let e = LlamaHyper::from_gguf(&GgufFile::parse(w.build()).unwrap()).unwrap_err();
    assert!(e.to_string().contains("gptneox"));
    let mut w = Writer::new();
    w.str("general.architecture", "llama")
        .u32("llama.block_count", 2);
    let e = LlamaHyper::from_gguf(&GgufFile::parse(w.build()).unwrap()).unwrap_err();
    assert!(e.to_string().contains("llama.embedding_length"), "{e}");
}

/// A file of architecture `arch` with the hyper-parameters of [`llama_file`] and `extra`.
fn arch_file(arch: &str, extra: impl FnOnce(&mut Writer)) -> GgufFile {
    let mut w = Writer::new();
    w.str("general.architecture", arch);
    for (k, v) in [
        ("block_count", 2),
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("context_length", 256),
        ("vocab_size", 10),
    ] {
        w.u32(&format!("{arch}.{k}"), v);
    }
    extra(&mut w);
    GgufFile::parse(w.build()).unwrap()
}

/// Adds every tensor of `h` (F32 zeros) but those named in `skip`, then `more`.
fn all_tensors(w: &mut Writer, h: &LlamaHyper, skip: &[&str], more: &[(&str, &[u64])]) {
    let zeros = |dims: &[u64]| vec![0u8; dims.iter().product::<u64>() as usize * 4];
    for (name, dims) in h.expected_tensors() {
        if !skip.contains(&name.as_str()) {
            w.tensor(&name, &dims, GgmlType::F32, zeros(&dims));
        }
    }
    for (name, dims) in more {
        w.tensor(name, dims, GgmlType::F32, zeros(dims));
    }
}

#[test]
fn qwen2_needs_its_biases_and_pairs_neox() {
    let f = arch_file("qwen2", |w| {
        w.f32("qwen2.rope.freq_base", 1e6);
    });
    let h = LlamaHyper::from_gguf(&f).unwrap();
    assert_eq!(h.architecture, "qwen2");
    assert!(h.qkv_bias && h.tied_embeddings);
    assert_eq!(h.rope_base, 1e6);
    assert_eq!(h.rope_style(), RopeStyle::NeoX);
    let names = h.expected_tensors();
    assert_eq!(names.len(), 2 + 2 * 12);
    assert!(names.contains(&("blk.1.attn_k.bias".into(), vec![32])));
    assert!(names.contains(&("blk.0.attn_q.bias".into(), vec![64])));
    let complete = arch_file("qwen2", |w| all_tensors(w, &h, &[], &[]));
    h.check_tensors(&complete).unwrap();
    let e = h
        .check_tensors(&arch_file("qwen2", |w| {
            all_tensors(w, &h, &["blk.1.attn_v.bias"], &[])
        }))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.1.attn_v.bias") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn llama_biases_are_optional_and_all_or_nothing() {
    let plain = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
    assert!(!plain.qkv_bias);
    // With blk.0.attn_q.bias the file has biases: every layer needs all three.
    let biased = LlamaHyper::from_gguf(&arch_file("llama", |w| {
        all_tensors(w, &plain, &[], &[("blk.0.attn_q.bias", &[64])]);
    }))
    .unwrap();
    assert!(biased.qkv_bias);
    assert_eq!(biased.rope_style(), RopeStyle::GptJ);
    let f = arch_file("llama", |w| {
        all_tensors(w, &plain, &[], &[("blk.0.attn_q.bias", &[64])]);
    });
    let e = biased.check_tensors(&f).unwrap_err().to_string();
    assert!(e.contains("blk.0.attn_k.bias"), "{e}");
    let f = arch_file("llama", |w| all_tensors(w, &biased, &[], &[]));
    biased.check_tensors(&f).unwrap();
}

#[test]
fn llama_rope_freqs_are_read_and_checked() {
    let plain = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
    let base = &plain;
    let with = |dims: &'static [u64]| {
        arch_file("llama", move |w| {
            all_tensors(w, base, &[], &[("rope_freqs.weight", dims)]);
        })
    };
    let h = LlamaHyper::from_gguf(&with(&[8])).unwrap();
    assert!(h.rope_freqs && !plain.rope_freqs);
    assert!(h
        .expected_tensors()
        .contains(&("rope_freqs.weight".into(), vec![8])));
    h.check_tensors(&with(&[8])).unwrap();
    let e = h.check_tensors(&with(&[16])).unwrap_err().to_string();
    assert!(e.contains("rope_freqs.weight") && e.contains("[16]"), "{e}");
    // qwen2 files have no frequency factors: one is a tensor the decoder would ignore.
    let q = LlamaHyper::from_gguf(&arch_file("qwen2", |_| {})).unwrap();
    let f = arch_file("qwen2", |w| {
        all_tensors(w, &q, &[], &[("rope_freqs.weight", &[8])]);
    });
    let q = LlamaHyper::from_gguf(&f).unwrap();
    assert!(!q.rope_freqs);
    let e = q.check_tensors(&f).unwrap_err().to_string();
    assert!(
        e.contains("rope_freqs.weight") && e.contains("frequency factors"),
        "{e}"
    );
}

#[test]
fn tensors_the_decoder_would_ignore_are_refused_by_name() {
    let h = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
    for (name, dims, also) in [
        ("blk.1.attn_output.bias", &[64u64][..], "ignore"),
        ("blk.0.attn_q.bias", &[64][..], "ignore"),
    ] {
        let f = arch_file("llama", |w| all_tensors(w, &h, &[], &[(name, dims)]));
        // blk.0.attn_q.bias turns the biases on when the file is read; checked against
        // the hyper-parameters of a file without it, it is one tensor too many.
        let e = h.check_tensors(&f).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains(also), "{e}");
    }
}

#[test]
fn scaled_rope_is_refused_by_name() {
    let refused = |extra: fn(&mut Writer), what: &[&str]| {
        let e = LlamaHyper::from_gguf(&arch_file("llama", extra))
            .unwrap_err()
            .to_string();
        assert!(what.iter().all(|w| e.contains(w)), "{e}");
    };
    refused(
        |w| {
            w.str("llama.rope.scaling.type", "yarn");
        },
        &["yarn", "llama.rope.scaling.type"],
    );
    refused(
        |w| {
            w.str("llama.rope.scaling.type", "linear")
                .f32("llama.rope.scaling.factor", 4.0);
        },
        &["llama.rope.scaling.factor", "4"],
    );
    refused(
        |w| {
            w.f32("llama.rope.scale_linear", 2.0);
        },
        &["llama.rope.scale_linear"],
    );
    // Unscaled spellings load.
    for extra in [
        (|w: &mut Writer| {
            w.str("llama.rope.scaling.type", "none");
        }) as fn(&mut Writer),
        |w| {
            w.str("llama.rope.scaling.type", "linear")
                .f32("llama.rope.scaling.factor", 1.0);
        },
        |w| {
            w.f32("llama.rope.scaling.factor", 0.0);
        },
    ] {
        LlamaHyper::from_gguf(&arch_file("llama", extra)).unwrap();
    }
    // An unknown architecture is named, with the supported ones.
    let e = LlamaHyper::from_gguf(&arch_file("phi3", |_| {}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("phi3") && e.contains("qwen2"), "{e}");
}
