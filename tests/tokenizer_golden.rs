//! The tokenizer against independent implementations: `tests/data/tokenizer_golden.json`, written
//! by `scripts/tokenizer-golden.py`, holds tiny vocabularies trained with Hugging Face
//! `tokenizers` (byte-level BPE with the gpt2, smollm, llama-bpe and qwen2 pre-tokenizers) and
//! `sentencepiece` (BPE with byte fallback), test strings, and the ids and decoded text those
//! libraries give. Every encoding must match id for id, and decoding (whole and streamed) must
//! give the libraries' text.

use kvattn::decoder::tokenizer::{
    PreTokenizer, TokenType, Tokenizer, TokenizerConfig, TokenizerModel,
};
use serde_json::Value;

fn golden() -> Value {
    let text = include_str!("data/tokenizer_golden.json");
    serde_json::from_str(text).expect("the golden file is JSON")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|i| i.as_u64().expect("an id") as u32)
        .collect()
}

fn types(v: &Value) -> Vec<TokenType> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|t| TokenType::from_id(t.as_i64().expect("a type") as i32).expect("a known type"))
        .collect()
}

/// Checks every case of one vocabulary; returns how many there were.
fn check_cases(name: &str, tok: &Tokenizer, cases: &Value) -> usize {
    let cases = cases.as_array().expect("cases");
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = ids(&case["ids"]);
        let got = tok.encode(text);
        let pieces = |ids: &[u32]| -> Vec<String> {
            ids.iter()
                .map(|&i| tok.id_to_token(i).unwrap_or("?").to_string())
                .collect()
        };
        assert_eq!(
            pieces(&got),
            pieces(&want),
            "{name}: encoding {text:?} (ids {got:?}, want {want:?})"
        );
        assert_eq!(got, want, "{name}: {text:?}");
        let decoded = case["decoded"].as_str().expect("decoded");
        assert_eq!(tok.decode(&want), decoded, "{name}: decoding {text:?}");
        let mut stream = tok.stream_decoder();
        let mut streamed: String = want.iter().map(|&i| stream.push(i)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, decoded, "{name}: streaming {text:?}");
    }
    cases.len()
}

#[test]
fn byte_level_bpe_matches_hugging_face_tokenizers() {
    let data = golden();
    let vocabularies = data["byte_level"].as_array().expect("byte_level");
    let mut seen = Vec::new();
    for v in vocabularies {
        let name = v["pre"].as_str().expect("pre");
        let pre = PreTokenizer::from_name(name).expect("a supported pre-tokenizer");
        let tok = Tokenizer::new(TokenizerConfig {
            model: TokenizerModel::Gpt2,
            tokens: strings(&v["tokens"]),
            token_types: types(&v["token_types"]),
            merges: strings(&v["merges"]),
            pre,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let n = check_cases(name, &tok, &v["cases"]);
        assert!(n >= 20, "{name}: {n} cases");
        seen.push(pre);
    }
    assert_eq!(
        seen,
        [
            PreTokenizer::Gpt2,
            PreTokenizer::Gpt2Digits,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2
        ]
    );
}

#[test]
fn sentencepiece_matches_google_sentencepiece() {
    let data = golden();
    let v = &data["sentencepiece"];
    let id = |key: &str| v[key].as_u64().map(|i| i as u32);
    let scores: Vec<f32> = v["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .map(|s| s.as_f64().expect("a score") as f32)
        .collect();
    let tok = Tokenizer::new(TokenizerConfig {
        model: TokenizerModel::SentencePiece,
        tokens: strings(&v["tokens"]),
        token_types: types(&v["token_types"]),
        scores,
        bos: id("bos"),
        eos: id("eos"),
        unk: id("unk"),
        add_bos: true,
        add_space_prefix: v["add_space_prefix"].as_bool().expect("add_space_prefix"),
        ..Default::default()
    })
    .expect("the SentencePiece vocabulary");
    let n = check_cases("sentencepiece", &tok, &v["cases"]);
    assert!(n >= 20, "{n} cases");
    // The vocabulary falls back to bytes for what training did not cover.
    let emoji = tok.encode("🦀");
    assert!(emoji
        .iter()
        .any(|&i| tok.token_type(i) == Some(TokenType::Byte)));
}
