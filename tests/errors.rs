//! The error type without a GPU: errors from other libraries keep them as their `source()`
//! (I/O, safetensors), the message names the operation and repeats the source's message,
//! tokenizer errors have a variant of their own, and `Error` crosses threads. The GPU cases
//! (wgpu's errors, snapshots) are in `tests/gpu/gpu_errors.rs`.

use std::error::Error as _;

use kvattn::Error;

/// Every message along `err`'s source chain, the error's own first.
fn chain(err: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut out = vec![err.to_string()];
    let mut next = err.source();
    while let Some(e) = next {
        out.push(e.to_string());
        next = e.source();
    }
    out
}

#[test]
fn error_is_send_sync_and_static() {
    fn assert_send_sync_static<T: Send + Sync + 'static>() {}
    assert_send_sync_static::<Error>();
    // So it boxes into what anyhow-style callers use, and its chain survives the box.
    let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "no entry");
    let boxed: Box<dyn std::error::Error + Send + Sync + 'static> = Box::new(Error::Io {
        what: "cannot read x.bin".into(),
        source: io,
    });
    let source = boxed.source().expect("the I/O error is the source");
    let io = source
        .downcast_ref::<std::io::Error>()
        .expect("an io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
}

#[test]
fn errors_without_a_source_have_none() {
    let err = Error::InvalidArgument("num_heads must be positive".into());
    assert!(err.source().is_none());
    assert_eq!(
        err.to_string(),
        "invalid argument: num_heads must be positive"
    );
    let err = Error::Tokenizer("vocabulary of 0 tokens".into());
    assert!(err.source().is_none());
    assert_eq!(err.to_string(), "tokenizer: vocabulary of 0 tokens");
}

#[test]
fn safetensors_errors_keep_their_source_and_message() {
    let source = match safetensors::SafeTensors::deserialize(b"not a tensor file") {
        Err(e) => e,
        Ok(_) => panic!("junk parsed as safetensors"),
    };
    let text = source.to_string();
    let err = Error::Safetensors {
        what: "snapshot: not safetensors".into(),
        source,
    };
    let shown = err.to_string();
    assert!(shown.starts_with("snapshot: not safetensors: "), "{shown}");
    assert!(shown.ends_with(&text), "{shown} lacks {text}");
    let source = err.source().expect("the safetensors error is the source");
    assert!(source
        .downcast_ref::<safetensors::SafeTensorError>()
        .is_some());
    assert_eq!(chain(&err)[1], text);
}

#[cfg(feature = "decoder")]
mod decoder {
    use std::error::Error as _;

    use kvattn::decoder::gguf::GgufFile;
    use kvattn::decoder::tokenizer::{PreTokenizer, Tokenizer, TokenizerConfig};
    use kvattn::Error;

    /// A GGUF v3 file with no tensors and these string metadata entries.
    fn gguf_with_strings(entries: &[(&str, &str)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes()); // tensors
        b.extend((entries.len() as u64).to_le_bytes());
        let string = |b: &mut Vec<u8>, s: &str| {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        };
        for (key, value) in entries {
            string(&mut b, key);
            b.extend(8u32.to_le_bytes()); // string
            string(&mut b, value);
        }
        b
    }

    #[test]
    fn a_missing_gguf_file_is_an_io_error_naming_the_path() {
        let path = std::env::temp_dir().join("kvattn-errors-test-no-such-model.gguf");
        let _ = std::fs::remove_file(&path);
        let err = GgufFile::open(&path).unwrap_err();
        let shown = err.to_string();
        assert!(shown.contains(&path.display().to_string()), "{shown}");
        assert!(shown.contains("cannot read"), "{shown}");
        let Error::Io { what, source } = &err else {
            panic!("expected Error::Io, got {err:?}");
        };
        assert!(what.contains(&path.display().to_string()), "{what}");
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        // The same error through the standard trait: the chain reaches the io::Error.
        let io = err
            .source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .expect("the io::Error is the source");
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
        // The message repeats the source's own, so printing the error alone says why.
        assert!(shown.ends_with(&io.to_string()), "{shown}");
    }

    #[test]
    fn a_corrupt_gguf_file_is_a_gguf_error_not_an_io_error() {
        let err = GgufFile::parse(b"GGUF\x01\0\0\0".to_vec()).unwrap_err();
        assert!(
            matches!(&err, Error::Gguf(m) if m.contains("version 1")),
            "{err}"
        );
        assert!(err.source().is_none());
    }

    #[test]
    fn tokenizer_errors_are_the_tokenizer_variant() {
        // An unsupported tokenizer model in an otherwise valid file: named, with the supported
        // ones.
        let file = GgufFile::parse(gguf_with_strings(&[("tokenizer.ggml.model", "t5")]))
            .expect("a valid GGUF file");
        match Tokenizer::from_gguf(&file) {
            Err(Error::Tokenizer(m)) => {
                assert!(m.contains("\"t5\"") && m.contains("not supported"), "{m}");
                assert!(m.contains("\"gpt2\"") && m.contains("\"llama\""), "{m}");
            }
            other => panic!("expected Error::Tokenizer, got {:?}", other.err()),
        }
        // A key the file lacks is still the file's fault: a GGUF error.
        let file = GgufFile::parse(gguf_with_strings(&[("general.name", "x")])).unwrap();
        match Tokenizer::from_gguf(&file) {
            Err(Error::Gguf(m)) => assert!(m.contains("tokenizer.ggml.model"), "{m}"),
            other => panic!("expected Error::Gguf, got {:?}", other.err()),
        }
        // A malformed merge, from parts: names the merge and what is wrong with it.
        let config = TokenizerConfig {
            tokens: vec!["a".into(), "b".into()],
            token_types: Vec::new(),
            merges: vec!["a b".into()],
            pre: PreTokenizer::Gpt2,
            ..TokenizerConfig::default()
        };
        match Tokenizer::new(config) {
            Err(e @ Error::Tokenizer(_)) => {
                let m = e.to_string();
                assert!(m.starts_with("tokenizer: merge 0 \"a b\""), "{m}");
                assert!(m.contains("not in the vocabulary"), "{m}");
            }
            other => panic!("expected Error::Tokenizer, got {:?}", other.err()),
        }
    }
}
