#!/usr/bin/env python3
"""Writes tests/data/tokenizer_golden.json: tiny vocabularies trained with Hugging Face
`tokenizers` and Google's `sentencepiece`, test strings and the ids those libraries give them,
the independent implementations kvattn's tokenizer (src/decoder/tokenizer/) is checked against
by tests/tokenizer_golden.rs.

Run once, from the repository root, in a virtual environment with the pinned packages:

    python3 -m venv /tmp/tok-golden-env
    /tmp/tok-golden-env/bin/pip install tokenizers==0.21.1 sentencepiece==0.2.0
    /tmp/tok-golden-env/bin/python scripts/tokenizer-golden.py

Byte-level BPE, one vocabulary per pre-tokenizer kvattn supports, each as llama.cpp's converter
would describe it in GGUF (`tokenizer.ggml.pre`):

- gpt2: the ByteLevel pre-tokenizer with its GPT-2 regex;
- smollm: every digit split off (Digits), then the same;
- llama-bpe: a Split on the Llama 3 regex, then ByteLevel without its regex, and the BPE model's
  `ignore_merges` (a piece that is a token is taken whole), as Llama 3's tokenizer.json has it;
- qwen2: the same with Qwen2's regex (single digits), without `ignore_merges`.

Each has two special tokens (`<|begin|>`, `<|end|>`; GGUF token type 3, control) that the test
strings use. SentencePiece: a BPE model with byte fallback and the settings of Llama 2's
tokenizer.model (identity normalization, a dummy prefix, extra whitespace kept, digits split,
whitespace-only pieces allowed); types from the processor (control, unknown, byte, unused,
else normal) and its scores.

The JSON holds, per vocabulary: tokens (by id), token types (GGUF numbering), merges
("left right", BPE) or scores (SentencePiece), and cases: text, ids and the library's decoding.
"""

import json
import os
import sys
import tempfile

import sentencepiece as spm
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = "tests/data/tokenizer_golden.json"
TOKENIZERS_VERSION = "0.21.1"
SENTENCEPIECE_VERSION = "0.2.0"

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

SPECIALS = ["<|begin|>", "<|end|>"]

# Training text, written for this script: prose, code, numbers, contractions, other scripts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog didn't mind; it's lazy.",
    "We'll meet at 10:30 on 2024-07-26, and they're bringing 12345 apples and 678 pears.",
    "She said: \"I'm sure you've seen it.\" He'd say the same, wouldn't he?",
    "def main():\n    for i in range(100):\n        print(i * 2)\n\n    return 0\n",
    "Line one\r\nLine two\r\n\r\nLine four   with   spaces\tand\ttabs.",
    "Crème brûlée, naïve façade, déjà vu, São Paulo, Zürich, Ångström.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Prices: $1,299.99 or €1.050,00; 50% off!!! Call +1 (555) 010-9999.",
    "    indented text follows here\n        and more indentation\n",
    "the theory of the thing: there, then, these, those, through, though.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 10000 3.14159 2.71828",
    "Hello world! Hello, World. HELLO WORLD? hello... world!!",
]

CASES = [
    "Hello world",
    "The quick brown fox didn't see the 12345 apples.",
    "I'M SURE YOU'VE SEEN IT, THEY'RE HERE. She'D go; we'Ll see.",
    "digits 0123456789 2024 3.14159 1234567 ٣٤٥ ½ and x2y",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   spaces\tand\t\ttabs \t mixed",
    "line\nbreaks\n\nand\n\n\nruns\n  indented\n",
    "crlf\r\nline\r\n\r\n  spaced\r\n",
    " \n \n  \t\n",
    "punctuation!!! ...and (brackets) [x] {y} <z> \"quotes\" 'single'",
    "Crème brûlée à São Paulo, Zürich",
    "東京は日本の首都です。",
    "emoji 🦀🚀 family 👨‍👩‍👧 flag 🇫🇷 done",
    "def f(x):\n    return x * 2\n",
    "non-breaking\u00a0space and ideographic\u3000space",
    "a \n\n b  \ny\t\tword   123 x\u2003y",
    "it's IT'S It'S 'tis 'Ll",
    "",
    "a",
    " ",
    "\n",
]

# The byte-level cases also carry special tokens.
SPECIAL_CASES = [
    "<|begin|>Hello<|end|>",
    "<|begin|> spaced <|end|>\n<|begin|>",
    "x<|end|><|end|>y",
]


def merges_of(tok):
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def byte_level(name, pre, ignore_merges):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    assert model.get("ignore_merges", False) == ignore_merges, name
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens), name
    types = [3 if t in SPECIALS else 1 for t in tokens]
    cases = []
    for text in CASES + SPECIAL_CASES:
        ids = tok.encode(text, add_special_tokens=False).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": decoded})
    return {
        "pre": name,
        "tokens": tokens,
        "token_types": types,
        "merges": merges_of(tok),
        "cases": cases,
    }


def sentencepiece():
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "sp")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS * 4),
            model_prefix=prefix,
            model_type="bpe",
            vocab_size=420,
            byte_fallback=True,
            character_coverage=0.995,
            normalization_rule_name="identity",
            add_dummy_prefix=True,
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=100000,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    n = sp.get_piece_size()
    tokens, types, scores = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_control(i):
            types.append(3)
        elif sp.is_unknown(i):
            types.append(2)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        else:
            types.append(1)
    cases = []
    for text in CASES:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    return {
        "tokens": tokens,
        "token_types": types,
        "scores": scores,
        "bos": sp.bos_id(),
        "eos": sp.eos_id(),
        "unk": sp.unk_id(),
        "add_space_prefix": True,
        "cases": cases,
    }


def main():
    if tokenizers.__version__ != TOKENIZERS_VERSION:
        sys.exit(f"tokenizers {tokenizers.__version__}, want {TOKENIZERS_VERSION}")
    if spm.__version__ != SENTENCEPIECE_VERSION:
        sys.exit(f"sentencepiece {spm.__version__}, want {SENTENCEPIECE_VERSION}")
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = lambda pattern: pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    data = {
        "generator": f"scripts/tokenizer-golden.py (tokenizers {TOKENIZERS_VERSION}, "
        f"sentencepiece {SENTENCEPIECE_VERSION})",
        "byte_level": [
            byte_level("gpt2", gpt2, False),
            byte_level(
                "smollm",
                pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(individual_digits=True), gpt2]
                ),
                False,
            ),
            byte_level("llama-bpe", pre_tokenizers.Sequence([split(LLAMA3), no_regex]), True),
            byte_level("qwen2", pre_tokenizers.Sequence([split(QWEN2), no_regex]), False),
        ],
        "sentencepiece": sentencepiece(),
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}: {os.path.getsize(OUT)} bytes")


if __name__ == "__main__":
    main()
