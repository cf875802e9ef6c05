#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, on the device machine, after staging mlx there
# (../shared/gpu/README.md: unpack.sh 1, then unpack.sh 2). Nothing is pip-installed there, so the
# repository runs from its root with kvstore/adapters and kvstore/tools linked in.
#   bash tools/gpu_bench.sh tests OUT      # the store's tests that need no Redis or hypothesis, on CUDA
#   TOKENS="2048 8192 32768" bash tools/gpu_bench.sh ssd OUT   # kvstore bench ssd, Llama-3-8B KV shape
#                                                               (PARTS=writes; PARTS=hot: RAM and device hits only)
#   bash tools/gpu_bench.sh model OUT      # the 8B-shaped random llama the next two use (/tmp/llama-8b)
#   LENGTHS="2048 8192" bash tools/gpu_bench.sh cost OUT   # kvstore bench cost: TTFT table on it (--fresh: FRESH=1;
#                                                          some rows only: SOURCES="device ram")
#   bash tools/gpu_bench.sh put OUT        # what storing a cache blocks the caller, through the adapters
#   bash tools/gpu_bench.sh gc OUT         # the garbage collector's pauses during puts (kvstore bench gc-pauses)
#   bash tools/gpu_bench.sh new-shapes OUT # what a new prompt shape costs mlx and whether 600 end a process, per setting
#                                          # (kvstore bench new-shapes), then tests/test_cuda_new_shapes.py
#   BUDGETS="0.25 0.1" bash tools/gpu_bench.sh replay OUT   # issues 42/54's live replay on it (tools/live_replay.py):
#                                                           each cache in a fresh process, --warm rounds (WARM=0: none),
#                                                           the H200 table's trace (TRACE=gpu45); some caches only:
#                                                           SYSTEMS="lru kvstore_fp16"; ROUNDS="fresh warm-engine",
#                                                           SSD=1 (kvstore's SSD tier), DROP=fadvise|drop_caches
#                                                           (once more, page cache dropped), WARMUP=N (warm-up's first
#                                                           N requests), DIR (stores: a disk, not tmpfs); PROFILE=1,
#                                                           SWITCH=S, IDLE=1: diagnoses
#   bash tools/gpu_bench.sh serve OUT      # 8 clients on the servers' trace (gpu): mlx_lm.server against kvstore serve
#   bash tools/gpu_bench.sh live OUT       # `replay` on the servers' trace (TRACE=gpu, into OUT/live), then `serve`
#                                          # (~6 min; `model` first, under a minute);
#                                          # SYSTEMS="none lru" BUDGETS="0.25" WARM=0
set -euo pipefail
source /tmp/site/env.sh
ln -sfn ../adapters kvstore/adapters
ln -sfn ../tools kvstore/tools
export PYTHONUNBUFFERED=1
M=/tmp/llama-8b
case $1 in
  tests) python3 -m pytest -q -p no:cacheprovider tests/test_gather.py tests/test_store.py tests/test_adapter_store.py \
           tests/test_restart.py tests/test_device_tier.py tests/test_cuda_staging.py tests/test_encode_runs.py \
           tests/test_warmup.py tests/test_writer.py tests/test_buffers.py tests/test_engine_handoff.py 2>&1 | tail -15 ;;
  ssd) for n in ${TOKENS:-8192 32768}; do
         python3 -m kvstore.tools.bench ssd --tokens "$n" --kv ${KVS:-fp16 q8 q4} --repeats 3 --dir /tmp \
           --parts ${PARTS:-reads writes} --out "$2/ssd-$n"
       done ;;
  model) python3 -m kvstore.tools.live_replay --make-model --model "$M" ;;
  cost) [[ -f $M/config.json ]] || bash "$0" model "$2"
        python3 -m kvstore.tools.bench cost --model "$M" --lengths ${LENGTHS:-2048 8192 32768} --kv ${KVS:-fp16 q8 q4} \
          --repeats "${REPEATS:-3}" ${FRESH:+--fresh} ${SOURCES:+--sources $SOURCES} --out "$2" ;;
  put) python3 -m kvstore.tools.put_cost --repeats "${REPEATS:-7}" --first-puts "${FIRST_PUTS:-5}" --out "$2" ;;
  gc) python3 -m kvstore.tools.bench gc-pauses --puts "${PUTS:-10}" --out "$2/gc.json" ;;
  new-shapes) python3 -m kvstore.tools.bench new-shapes --parts sdpa --shapes "${SHAPES:-600}" --out "$2/new-shapes-sdpa.json"
              python3 -m kvstore.tools.bench new-shapes --parts prefill --settings mlx-default check-off cudnn-off \
                --shapes "${SHAPES:-600}" --out "$2/new-shapes-prefill.json"
              python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_new_shapes.py 2>&1 | tail -5 ;;
  replay) [[ -f $M/config.json ]] || bash "$0" model "$2"
          python3 -m kvstore.tools.live_replay --model "$M" --trace "${TRACE:-gpu45}" --budgets ${BUDGETS:-0.25 0.1} \
            --systems ${SYSTEMS:-none lru kvstore_fp16 kvstore_q8} --fresh-process \
            $([[ ${WARM:-1} == 1 ]] && echo --warm) ${PROFILE:+--profile} ${SWITCH:+--switch-interval $SWITCH} \
            --rounds ${ROUNDS:-fresh} ${SSD:+--ssd} ${DROP:+--drop-page-cache $DROP} ${WARMUP:+--warm-up-requests $WARMUP} \
            ${IDLE:+--idle-writer} --dir "${DIR:-/tmp/live-replay}" --out "$2" ;;
  live) TRACE=gpu bash "$0" replay "$2/live"
        bash "$0" serve "$2" ;;
  serve) [[ -f $M/config.json ]] || bash "$0" model "$2"   # 8 clients: mlx_lm.server against kvstore serve
         python3 -m kvstore.tools.live_replay serve --model "$M" --trace gpu --clients "${CLIENTS:-8}" --out "$2/live-serve" ;;
esac
