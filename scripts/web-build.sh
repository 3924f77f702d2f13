#!/usr/bin/env bash
# Builds the web page (web/): the kvattn-web crate for wasm32-unknown-unknown in release, then
# wasm-bindgen's JS glue into web/pkg/. Installs what it lacks: the wasm32 target (rustup) and
# wasm-bindgen-cli at the exact version of Cargo.lock's wasm-bindgen (cargo install; npm's
# wasm-pack would download binaries, which these machines cannot).
# Then serve web/ over http (e.g. `python3 -m http.server -d web 8000`) and open
# http://localhost:8000/ in a browser with WebGPU, or run scripts/web-test.py.
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target list --installed | grep -qx wasm32-unknown-unknown ||
  rustup target add wasm32-unknown-unknown

version=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/"/, "", $3); print $3 }' Cargo.lock)
if [ -z "$version" ]; then
  echo "error: no wasm-bindgen in Cargo.lock" >&2
  exit 1
fi
if ! wasm-bindgen --version 2>/dev/null | grep -qx "wasm-bindgen $version"; then
  # --debug: half the build time of a release install (1.5 against 3.5 minutes on 2 cores); it
  # still writes the glue of this module in 2 seconds, byte for byte as a release build does.
  cargo install --quiet --debug wasm-bindgen-cli --version "$version"
fi

cargo build -p kvattn-web --profile web --locked --target wasm32-unknown-unknown
rm -rf web/pkg
wasm-bindgen --target web --no-typescript --out-dir web/pkg \
  target/wasm32-unknown-unknown/web/kvattn_web.wasm
ls -l web/pkg
