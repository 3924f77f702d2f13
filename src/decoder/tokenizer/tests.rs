//! Tokenizer tests on hand-made vocabularies (the golden test, `tests/tokenizer_golden.rs`,
//! checks trained ones against Hugging Face `tokenizers` and `sentencepiece`).

use super::bpe::byte_to_char_table;
use super::pretokenize::Splitter;
use super::*;

/// A tiny byte-level vocabulary: three control tokens, the 256 byte characters, and `extra`.
fn tiny(merges: &[&str], extra: &[&str], pre: PreTokenizer) -> Tokenizer {
    let b2c = byte_to_char_table();
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![TokenType::Control; 3];
    for c in b2c {
        tokens.push(c.to_string());
        types.push(TokenType::Normal);
    }
    for t in extra {
        tokens.push(t.to_string());
        types.push(TokenType::Normal);
    }
    Tokenizer::new(TokenizerConfig {
        tokens,
        token_types: types,
        merges: merges.iter().map(|s| s.to_string()).collect(),
        pre,
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        chat_template: Some(SMOLLM_TEMPLATE.into()),
        ..Default::default()
    })
    .unwrap()
}

/// A ChatML template with a default system message, as SmolLM2's.
const SMOLLM_TEMPLATE: &str =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
     {{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
     Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + \
     message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
     {{ '<|im_start|>assistant\n' }}{% endif %}";

fn strs(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| tok.id_to_token(i).unwrap().to_string())
        .collect()
}

fn split(pre: PreTokenizer, text: &str) -> Vec<String> {
    let pieces = Splitter::new(pre).unwrap().split(text);
    assert_eq!(pieces.concat(), text, "the pieces cover the text");
    pieces.into_iter().map(String::from).collect()
}

#[test]
fn byte_alphabet() {
    let t = byte_to_char_table();
    assert_eq!(t[b' ' as usize], 'Ġ');
    assert_eq!(t[b'\n' as usize], 'Ċ');
    assert_eq!(t[b'a' as usize], 'a');
    assert_eq!(t[0], 'Ā');
    assert_eq!(t[0xA0], 'ł');
    assert_eq!(t[0xAD], 'Ń');
    let mut sorted = t.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 256);
}

#[test]
fn pre_split_matches_the_gpt2_regex() {
    let cases: &[(&str, &[&str])] = &[
        ("Hello world", &["Hello", " world"]),
        ("a   b", &["a", "  ", " b"]),
        ("x\n\ny", &["x", "\n", "\n", "y"]),
        ("x\n\n y", &["x", "\n\n", " y"]),
        ("end  ", &["end", "  "]),
        ("I'm don't we'll", &["I", "'m", " don", "'t", " we", "'ll"]),
        ("I'M", &["I", "'", "M"]),
        ("hello!!! ok?", &["hello", "!!!", " ok", "?"]),
        ("été 東京", &["été", " 東京"]),
        ("\t\tx", &["\t", "\t", "x"]),
    ];
    for (text, want) in cases {
        assert_eq!(split(PreTokenizer::Gpt2, text), *want, "{text:?}");
    }
    assert_eq!(split(PreTokenizer::Gpt2, "abc 123"), ["abc", " 123"]);
    assert_eq!(
        split(PreTokenizer::Gpt2Digits, "abc 123"),
        ["abc", " ", "1", "2", "3"]
    );
    assert_eq!(
        split(PreTokenizer::Gpt2Digits, "x1y ٣"),
        ["x", "1", "y", " ", "٣"]
    );
}

#[test]
fn pre_split_matches_the_llama3_and_qwen2_regexes() {
    // Worked out by hand from the patterns (module docs of pretokenize.rs), alternative by
    // alternative; the golden test checks the same against Hugging Face.
    let both: &[(&str, &[&str])] = &[
        ("Hello world", &["Hello", " world"]),
        // Contractions in any case.
        ("I'M don'T", &["I", "'M", " don", "'T"]),
        // One character that is not a letter, digit or line break leads a word.
        ("(hello \tx", &["(hello", " ", "\tx"]),
        ("a   b", &["a", "  ", " b"]),
        ("end  ", &["end", "  "]),
        ("\t\tx", &["\t", "\tx"]),
        // Line breaks: a run of whitespace holding one goes up to its last \r or \n, whatever
        // follows; punctuation keeps the line breaks after it.
        ("x\n\ny", &["x", "\n\n", "y"]),
        ("x\n\n y", &["x", "\n\n", " y"]),
        ("a  \n b", &["a", "  \n", " b"]),
        ("x \r\n\r\n  ", &["x", " \r\n\r\n", "  "]),
        ("hello!!!\n\nok", &["hello", "!!!\n\n", "ok"]),
        ("a \n", &["a", " \n"]),
        ("été 東京", &["été", " 東京"]),
    ];
    for pre in [PreTokenizer::Llama3, PreTokenizer::Qwen2] {
        for (text, want) in both {
            assert_eq!(split(pre, text), *want, "{pre:?} {text:?}");
        }
    }
    assert_eq!(
        split(PreTokenizer::Llama3, "12345 67"),
        ["123", "45", " ", "67"]
    );
    assert_eq!(
        split(PreTokenizer::Qwen2, "12345 67"),
        ["1", "2", "3", "4", "5", " ", "6", "7"]
    );
    assert_eq!(
        split(PreTokenizer::Llama3, "x2024y"),
        ["x", "202", "4", "y"]
    );
}

#[test]
fn pre_tokenizer_names() {
    for (name, pre) in [
        ("gpt2", PreTokenizer::Gpt2),
        ("gpt-2", PreTokenizer::Gpt2),
        ("default", PreTokenizer::Gpt2),
        ("smollm", PreTokenizer::Gpt2Digits),
        ("starcoder", PreTokenizer::Gpt2Digits),
        ("llama-bpe", PreTokenizer::Llama3),
        ("llama3", PreTokenizer::Llama3),
        ("llama-v3", PreTokenizer::Llama3),
        ("qwen2", PreTokenizer::Qwen2),
    ] {
        assert_eq!(PreTokenizer::from_name(name), Some(pre), "{name}");
        assert!(PreTokenizer::NAMES.contains(&name));
    }
    assert_eq!(PreTokenizer::NAMES.len(), 9);
    assert_eq!(PreTokenizer::from_name("deepseek-llm"), None);
    assert_eq!(PreTokenizer::from_name("Qwen2"), None);
}

#[test]
fn bpe_applies_merges_by_rank() {
    // "e l" outranks "h e": "hell" -> h, el, l (not he, ll).
    let t = tiny(
        &["e l", "h e", "l l"],
        &["el", "he", "ll"],
        PreTokenizer::Gpt2,
    );
    assert_eq!(strs(&t, &t.encode("hell")), ["h", "el", "l"]);
    assert_eq!(strs(&t, &t.encode("hello")), ["h", "el", "l", "o"]);
    // Ties go left: "aaa" -> aa, a.
    let t = tiny(&["a a"], &["aa"], PreTokenizer::Gpt2);
    assert_eq!(strs(&t, &t.encode("aaa")), ["aa", "a"]);
    assert_eq!(strs(&t, &t.encode("aaaa")), ["aa", "aa"]);
    // Chained merges with the space character.
    let t = tiny(
        &["h e", "Ġ t", "Ġt he"],
        &["he", "Ġt", "Ġthe"],
        PreTokenizer::Gpt2,
    );
    assert_eq!(strs(&t, &t.encode("the the")), ["t", "he", "Ġthe"]);
    assert_eq!(t.decode(&t.encode("the the")), "the the");
    // Merges are checked.
    let err = |m: &str| {
        let mut c = TokenizerConfig {
            tokens: vec!["a".into(), "b".into(), "ab".into()],
            merges: vec![m.into()],
            ..Default::default()
        };
        let ok = Tokenizer::new(c.clone()).is_ok();
        c.merges.clear();
        c.bos = Some(3);
        assert!(Tokenizer::new(c).is_err());
        ok
    };
    assert!(err("a b"));
    assert!(!err("a c"));
    assert!(!err("b a"));
    assert!(!err("ab"));
}

#[test]
fn llama3_takes_a_piece_that_is_a_token_whole() {
    // "xyz" is a token no merge makes: Llama 3 (ignore_merges) takes it whole, the others go
    // by the merges.
    let extra = ["xy", "xyz", "Ġxyz"];
    let merges = ["x y"];
    let l = tiny(&merges, &extra, PreTokenizer::Llama3);
    let q = tiny(&merges, &extra, PreTokenizer::Qwen2);
    assert_eq!(strs(&l, &l.encode("xyz xyz")), ["xyz", "Ġxyz"]);
    assert_eq!(strs(&q, &q.encode("xyz xyz")), ["xy", "z", "Ġ", "xy", "z"]);
    assert_eq!(l.decode(&l.encode("xyz xyz")), "xyz xyz");
}

#[test]
fn control_tokens_are_single_ids() {
    let t = tiny(&[], &[], PreTokenizer::Gpt2);
    let ids = t.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>");
    assert_eq!(ids[0], 1);
    assert_eq!(ids[ids.len() - 2..], [2, 0]);
    assert_eq!(
        strs(&t, &ids[1..ids.len() - 2]),
        ["u", "s", "e", "r", "Ċ", "h", "i"]
    );
    assert_eq!(
        t.decode(&ids),
        "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    );
    // A partial control token is plain text.
    assert_eq!(t.decode(&t.encode("<|im_sta")), "<|im_sta");
    assert!(!t.encode("<|im_sta").contains(&1));
    assert!(t.is_control(1) && !t.is_control(3));
    assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.unk_id(), t.vocab_size()),
        (Some(1), Some(2), Some(0), 259)
    );
    assert_eq!(t.model(), TokenizerModel::Gpt2);
    assert!(!t.add_space_prefix());
}

const ROUND_TRIP: &[&str] = &[
    "",
    "Hello, world! The year is 2024.",
    "Crème brûlée à la française, naïve façade",
    "東京は日本の首都です。北京",
    "emoji 🦀🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "digits 0123456789 ٣٤ ½",
    "   leading spaces, tabs\t\tand\n\n\nnewlines \r\n end   ",
    "I'M don'T, they'Re",
    "\u{0}\u{1}\u{7f} controls",
];

#[test]
fn round_trip() {
    for pre in [
        PreTokenizer::Gpt2,
        PreTokenizer::Gpt2Digits,
        PreTokenizer::Llama3,
        PreTokenizer::Qwen2,
    ] {
        let t = tiny(
            &["h e", "Ġ t", "Ġt he", "l l"],
            &["he", "Ġt", "Ġthe", "ll"],
            pre,
        );
        for s in ROUND_TRIP
            .iter()
            .chain(&["mixed <|im_start|> control <|im_end|> tokens"])
        {
            let ids = t.encode(s);
            assert_eq!(t.decode(&ids), *s, "{pre:?}");
            // Streaming gives the same text.
            let mut sd = t.stream_decoder();
            let mut text: String = ids.iter().map(|&i| sd.push(i)).collect();
            text.push_str(&sd.finish());
            assert_eq!(text, *s, "{pre:?}");
        }
    }
}

#[test]
fn stream_decoder_waits_for_whole_characters() {
    let t = tiny(&[], &[], PreTokenizer::Gpt2);
    let ids = t.encode("é🦀");
    assert_eq!(ids.len(), 6); // 2 + 4 byte tokens
    let mut sd = t.stream_decoder();
    assert_eq!(sd.push(ids[0]), "");
    assert_eq!(sd.pending_bytes(), 1);
    assert_eq!(sd.push(ids[1]), "é");
    for &i in &ids[2..5] {
        assert_eq!(sd.push(i), "");
    }
    assert_eq!(sd.push(ids[5]), "🦀");
    assert_eq!(sd.finish(), "");
    // Invalid bytes become U+FFFD, at once when they cannot start a character, at the end
    // when they are a dangling start.
    let byte = |b: u8| {
        t.token_to_id(&byte_to_char_table()[b as usize].to_string())
            .unwrap()
    };
    assert_eq!(sd.push(byte(0xFF)), "\u{FFFD}");
    assert_eq!(sd.push(byte(b'a')), "a");
    assert_eq!(sd.push(byte(0xE6)), "");
    assert_eq!(sd.push(byte(b'b')), "\u{FFFD}b");
    assert_eq!(sd.push(byte(0xF0)), "");
    assert_eq!(sd.finish(), "\u{FFFD}");
    assert_eq!(t.decode(&[byte(0xE6), byte(b'b')]), "\u{FFFD}b");
    assert_eq!(t.decode(&[100_000]), "\u{FFFD}");
}

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens (when `bytes`), then
/// `pieces` with their scores.
fn spm(pieces: &[(&str, f32)], bytes: bool, add_space_prefix: bool) -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control];
    let mut scores = vec![0.0; 3];
    if bytes {
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TokenType::Byte);
            scores.push(0.0);
        }
    }
    for &(p, s) in pieces {
        tokens.push(p.into());
        types.push(TokenType::Normal);
        scores.push(s);
    }
    Tokenizer::new(TokenizerConfig {
        model: TokenizerModel::SentencePiece,
        tokens,
        token_types: types,
        scores,
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: true,
        add_space_prefix,
        ..Default::default()
    })
    .unwrap()
}

const LETTERS: [(&str, f32); 5] = [
    ("▁", -1.0),
    ("a", -2.0),
    ("b", -3.0),
    ("c", -4.0),
    ("é", -5.0),
];

#[test]
fn sentencepiece_merges_by_score() {
    let with = |extra: &[(&str, f32)], prefix: bool| {
        let mut p = LETTERS.to_vec();
        p.extend_from_slice(extra);
        spm(&p, true, prefix)
    };
    // ▁a outscores ab: ▁a first, then bc (▁ab is not a token).
    let t = with(&[("▁a", -10.0), ("ab", -11.0), ("bc", -12.0)], true);
    assert_eq!(strs(&t, &t.encode("abc")), ["▁a", "bc"]);
    // ab outscores ▁a: ab first, then nothing joins ▁ + ab or ab + c.
    let t = with(&[("▁a", -11.0), ("ab", -10.0), ("bc", -12.0)], true);
    assert_eq!(strs(&t, &t.encode("abc")), ["▁", "ab", "c"]);
    // ... unless abc is a token: then ab + c merges.
    let t = with(&[("▁a", -11.0), ("ab", -10.0), ("abc", -20.0)], true);
    assert_eq!(strs(&t, &t.encode("abc")), ["▁", "abc"]);
    // Equal scores: the leftmost pair first.
    let t = with(&[("aa", -10.0)], false);
    assert_eq!(strs(&t, &t.encode("aaa")), ["aa", "a"]);
    assert_eq!(strs(&t, &t.encode("aaaaa")), ["aa", "aa", "a"]);
    // Spaces are ▁, each text between special tokens gets one in front.
    let t = with(&[("▁a", -10.0), ("▁▁", -11.0)], true);
    assert_eq!(strs(&t, &t.encode("a a")), ["▁a", "▁a"]);
    // ▁a outscores ▁▁.
    assert_eq!(strs(&t, &t.encode(" a")), ["▁", "▁a"]);
    assert_eq!(strs(&t, &t.encode("  ")), ["▁▁", "▁"]);
    assert_eq!(strs(&t, &t.encode("a</s>a")), ["▁a", "</s>", "▁a"]);
    assert_eq!(t.encode(""), [] as [u32; 0]);
    assert_eq!(t.encode_prompt("a"), [1, t.token_to_id("▁a").unwrap()]);
    let t = with(&[("▁a", -10.0)], false);
    assert_eq!(strs(&t, &t.encode("a a")), ["a", "▁a"]);
}

#[test]
fn sentencepiece_falls_back_to_bytes_or_unk() {
    let t = spm(&LETTERS, true, true);
    // 東 is not a token: its three UTF-8 bytes.
    assert_eq!(
        strs(&t, &t.encode("a東")),
        ["▁", "a", "<0xE6>", "<0x9D>", "<0xB1>"]
    );
    assert_eq!(t.decode(&t.encode("a東 é")), "a東 é");
    // Without byte tokens: the unknown token, once per character.
    let t = spm(&LETTERS, false, true);
    assert_eq!(
        strs(&t, &t.encode("a東京b")),
        ["▁", "a", "<unk>", "<unk>", "b"]
    );
    assert_eq!(t.decode(&t.encode("a東")), "a<unk>");
    // Byte tokens must look like bytes; scores must match the vocabulary and not be NaN.
    let bad = |tokens: Vec<&str>, types: Vec<TokenType>, scores: Vec<f32>| {
        Tokenizer::new(TokenizerConfig {
            model: TokenizerModel::SentencePiece,
            tokens: tokens.into_iter().map(String::from).collect(),
            token_types: types,
            scores,
            ..Default::default()
        })
        .unwrap_err()
        .to_string()
    };
    let e = bad(
        vec!["a", "<0xG1>"],
        vec![TokenType::Normal, TokenType::Byte],
        vec![],
    );
    assert!(e.contains("byte token 1") && e.contains("<0xG1>"), "{e}");
    let e = bad(vec!["a", "b"], vec![], vec![0.0]);
    assert!(e.contains("1 scores for 2 tokens"), "{e}");
    let e = bad(vec!["a", "b"], vec![], vec![0.0, f32::NAN]);
    assert!(e.contains("token 1 has a NaN score"), "{e}");
}

#[test]
fn sentencepiece_decodes_without_the_prefix_space() {
    let mut p = LETTERS.to_vec();
    p.extend_from_slice(&[("▁a", -10.0), ("▁b", -11.0), ("▁▁", -12.0)]);
    let t = spm(&p, true, true);
    for s in ROUND_TRIP.iter().chain(&["<s>ab ba", " a", "  b"]) {
        let ids = t.encode(s);
        assert_eq!(t.decode(&ids), *s);
        let mut sd = t.stream_decoder();
        let mut text: String = ids.iter().map(|&i| sd.push(i)).collect();
        text.push_str(&sd.finish());
        assert_eq!(text, *s);
    }
    // The space is dropped from the first token that is not a control token, only.
    let id = |s: &str| t.token_to_id(s).unwrap();
    assert_eq!(t.decode(&[id("<s>"), id("▁a"), id("▁b")]), "<s>a b");
    assert_eq!(t.decode(&[id("a"), id("▁b")]), "a b");
    assert_eq!(t.decode(&[id("<0x20>"), id("▁b")]), "  b");
    let mut sd = t.stream_decoder();
    assert_eq!(sd.push(id("<s>")), "<s>");
    assert_eq!(sd.push(id("▁a")), "a");
    assert_eq!(sd.push(id("▁b")), " b");
    assert_eq!(sd.finish(), "");
    assert_eq!(sd.push(id("▁a")), "a");
    // Without the prefix nothing is dropped.
    let t = spm(&p, true, false);
    assert_eq!(t.decode(&[id("▁a"), id("▁b")]), " a b");
    assert_eq!(t.decode(&t.encode(" a b")), " a b");
}

#[test]
fn from_gguf_metadata() {
    use crate::decoder::gguf::tests::Writer;
    let mut toks: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    toks.extend(byte_to_char_table().iter().map(|c| c.to_string()));
    toks.push("Ġt".into());
    let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
    let mut types = vec![3, 3, 3];
    types.extend(vec![1; 257]);
    let build = |model: &str, pre: &str, types: &[i32]| {
        let mut w = Writer::new();
        w.str("tokenizer.ggml.model", model)
            .str("tokenizer.ggml.pre", pre)
            .str_array("tokenizer.ggml.tokens", &refs)
            .i32_array("tokenizer.ggml.token_type", types)
            .str_array("tokenizer.ggml.merges", &["Ġ t"])
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2)
            .u32("tokenizer.ggml.unknown_token_id", 0)
            .bool("tokenizer.ggml.add_bos_token", true)
            .str(
                "tokenizer.chat_template",
                "<|im_start|>{{ messages[0].role }}<|im_end|>",
            );
        Tokenizer::from_gguf(&GgufFile::parse(w.build()).unwrap())
    };
    let t = build("gpt2", "smollm", &types).unwrap();
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Gpt2Digits);
    assert_eq!(strs(&t, &t.encode(" t1")), ["Ġt", "1"]);
    assert_eq!(t.encode_prompt("t")[0], 1);
    assert!(t.add_bos());
    assert_eq!(
        t.chat_prompt(&[("user", "x")], false).unwrap(),
        "<|im_start|>user<|im_end|>"
    );
    let t = build("gpt2", "llama-bpe", &types).unwrap();
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Llama3);
    assert_eq!(t.encode(" t1").len(), 2);
    let e = build("t5", "smollm", &types).unwrap_err().to_string();
    assert!(
        e.contains("\"t5\"") && e.contains("not supported") && e.contains("\"llama\""),
        "{e}"
    );
    let e = build("gpt2", "deepseek-coder", &types)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"deepseek-coder\"") && e.contains("llama-bpe") && e.contains("qwen2"),
        "{e}"
    );
    let mut bad = types.clone();
    bad[7] = 9;
    assert!(build("gpt2", "smollm", &bad)
        .unwrap_err()
        .to_string()
        .contains("token type 9"));
    assert!(build("gpt2", "smollm", &types[1..]).is_err());
}

#[test]
fn from_gguf_sentencepiece() {
    use crate::decoder::gguf::tests::Writer;
    let mut toks = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        toks.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for p in ["▁", "h", "i", "▁h", "▁hi"] {
        toks.push(p.into());
        types.push(1);
    }
    let mut scores = vec![0.0f32; toks.len()];
    let n = scores.len();
    scores[n - 2] = -1.0; // ▁h
    scores[n - 1] = -2.0; // ▁hi
    let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
    let build = |prefix: Option<bool>, with_scores: bool| {
        let mut w = Writer::new();
        w.str("tokenizer.ggml.model", "llama")
            .str_array("tokenizer.ggml.tokens", &refs)
            .i32_array("tokenizer.ggml.token_type", &types)
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2)
            .u32("tokenizer.ggml.unknown_token_id", 0);
        if with_scores {
            w.f32_array("tokenizer.ggml.scores", &scores);
        }
        if let Some(p) = prefix {
            w.bool("tokenizer.ggml.add_space_prefix", p);
        }
        Tokenizer::from_gguf(&GgufFile::parse(w.build()).unwrap())
    };
    let t = build(None, true).unwrap();
    assert_eq!(t.model(), TokenizerModel::SentencePiece);
    assert!(t.add_bos() && t.add_space_prefix());
    assert_eq!(strs(&t, &t.encode_prompt("hi")), ["<s>", "▁hi"]);
    assert_eq!(t.decode(&t.encode_prompt("hi hé")), "<s>hi hé");
    let t = build(Some(false), true).unwrap();
    assert_eq!(strs(&t, &t.encode("hi")), ["h", "i"]);
    let e = build(None, false).unwrap_err();
    assert!(
        matches!(&e, Error::Gguf(m) if m.contains("tokenizer.ggml.scores")),
        "{e}"
    );
    // No chat template: a tokenizer error that says so.
    let e = build(None, true)
        .unwrap()
        .chat_prompt(&[("user", "x")], true)
        .unwrap_err();
    assert!(
        matches!(&e, Error::Tokenizer(m) if m.contains("no chat template")),
        "{e}"
    );
}

#[test]
fn chat_prompt_chatml() {
    let t = tiny(&[], &[], PreTokenizer::Gpt2);
    let sys = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
    assert_eq!(
        t.chat_prompt(&[("user", "Hi!")], true).unwrap(),
        format!("{sys}<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    );
    assert_eq!(
        t.chat_prompt(
            &[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("assistant", "Hello."),
                ("user", "Bye")
            ],
            false
        )
        .unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
    assert_eq!(t.chat_prompt(&[], true).unwrap(), "<|im_start|>assistant\n");
    // Content is not interpreted as template syntax.
    assert_eq!(
        t.chat_prompt(&[("system", "{{ 1 + 1 }} {% if %}")], false)
            .unwrap(),
        "<|im_start|>system\n{{ 1 + 1 }} {% if %}<|im_end|>\n"
    );
}
