#!/usr/bin/env bash
# One device call that runs the whole GPU programme and leaves receipts in $OUT.
#   bash experiments/gpu_session.sh [step ...]                  # one GPU, steps in order
#   bash experiments/gpu_session.sh step ... :: step ... [:: ...]  # one lane per GPU
# Steps: parity parity_split audit audit_qwen3 audit_gemma3 audit_xla kernels
# kernels_fused spec sweep tuned e2e e2e_b1 e2e_b8 e2e_peers e2e_draftpallas e2e_decompose train pair
# pair_eval schedsweep attnsweep train_head parity_trees kernels_trees main pair_head
# e2e_session tree_sweep parity_long parity_long_xla context_bench context_bench_128k
# e2e_batch chunk_cost moe_cost moe_parity moe_e2e tallsweep prefillsweep serial_split e2e_context profile groupsweep
# combinesweep routesweep mosaic_attention mosaic mosaic_top_p mosaic_swapped mosaic_prefill
# mosaic_ws mosaic_unfused profile_prefill
# e2e_mosaic moe_mosaic table
# splitk_sweep
# loop_cmdbuf
# (default: parity audit kernels spec); table copies the device's matmul_tuned.json to $OUT.
# - mosaic_swapped: tuning/mosaic_matmul.py --swapped (the swapped design's bits and time
#   against the plain one and Triton, Qwen3-8B weights), writing the passing, faster configs
#   into pallas_kernels/mosaic/matmul_tuned.json (copied to $OUT) for a later `mosaic` step
#   ($MOSAIC_TOPP=0 skips its top-p) to prove. $MSW_CONFIGS: the variants, s:bk:stages
#   (timed at M = 1, 17) or s:bk:stages:token_tiles[:w] (also at 160: one program a column
#   block; w: one wgmma of N = 160; :kS: K in S chunks, its own bits); $MSW_SHAPES
#   (default the model's: Qwen3-8B's five), $MSW_MODEL (qwen3-30b-a3b: the mixture of
#   experts' dense weights), $MSW_ROWS, $MSW_ALONE, $MSW_TAG, $MSW_S, $MSW_BUDGET.
# - mosaic_prefill: tuning/mosaic_matmul.py's plain tiles for prefill launches (past
#   PREFILL_ROWS rows) at M = 512 / 2,048, each's bits against the library config's, the
#   winners written as the weights' `prefill` tiles for a `mosaic` step to prove
#   ($MPF_SHAPES, $MPF_CONFIGS bn:bk:stages, $MPF_S, $MPF_BUDGET).
# - profile_prefill: profile_step.py --prefill, one prompt's chunked prefill ($PP_CONTEXT
#   tokens, default 512; $PP_PRESET, default qwen3-8b) on each of $PP_LOWERINGS.
# - mosaic_ws: tuning/mosaic_prefill.py, the warp-specialized prefill matmul's variants at
#   M = 511 / 2,048 against the library launch, Triton and XLA's dot, each's bits against
#   the library launch's and decode rows alone; the winners written as the weights'
#   `prefill` tiles (design ws) for a `mosaic` step to prove ($MPW_SHAPES, $MPW_FLAGS,
#   $MPW_S, $MPW_BUDGET, $MPW_TAG); MPW_FLAGS=--tier=tall: the tall verify blocks' tiles
#   (M = 80 / 160 / 320, each weight's tile from the row count it wins at up); a variant
#   ending in :c2 runs CTA pairs that share x's block (TMA multicast).
# - mosaic: the lowering="mosaic" model (every kernel of a dense forward on Mosaic GPU,
#   attention and trees included): the parity matrix at 8K on Qwen3-8B:4 and
#   Gemma-3-4B:6 with ragged batches and trees of 8-64 nodes ($MOSAIC_MODELS,
#   $MOSAIC_TREES, $MOSAIC_PARITY_S), tuning/mosaic_top_p.py (the top-p cut's rows
#   alone and among 160, against Triton), then bench_kernels.py's whole steps at the
#   Qwen3-8B shape (36 layers), Triton and Mosaic GPU side by side at batches 1 / 8,
#   T = 1 / 5 / 17, contexts $MOSAIC_CONTEXTS (default "512 8192"; $MOSAIC_KERNELS_S).
#   mosaic_unfused: the matrix on Qwen3-8B:4 with the kernels a default forward skips,
#   the unfused GLU and row-parallel partials (mosaic+no_fuse_glu, --row_partials=2);
#   then bench_kernels.py's steps (4 layers), mosaic+no_fuse_glu's bits against mosaic's.
#   e2e_mosaic: bench_e2e.py at the Qwen3-8B shape (36 layers), serial and a feature
#   head (gamma 4, a = 0.8), batches $E2E_BATCHES (default 1,8), once a lowering.
#   $MOSAIC_OPTIONS (default mosaic, e.g. mosaic,attn_split=512) is the Mosaic model's
#   options string in both steps; $MOSAIC_TAG names the matrix's receipts.
#   loop_cmdbuf: the same on Triton at batches $E2E_BATCHES (default 1; $E2E_TARGET, e.g.
#   qwen3-8b:12), with XLA's default command buffers, then with while loops and
#   conditionals inside them too.
# - mosaic_attention: tuning/mosaic_attention.py, split-KV attention on Mosaic GPU at the
#   Llama-3-8B attention shape, contexts 2K and 8K: each token's bits alone, in verify
#   blocks of 5 / 17 / 33, in a batch of 8 and a doubled cache of garbage; speed against
#   the Triton split path at batch 1 / 8, T = 1 / 5, and its scheduling variants (one K/V
#   slot, the fold in one launch) timed in turn, their bits against the default's
#   ($MATT_FLAGS, $MATT_S).
# - parity_long: the long-context lane of the parity matrix (pallas): a chunked prefill to
#   depth, then one-token steps, blocks, verify blocks of 1-32 and trees of 16 and 32
#   nodes at that depth, against serial decoding there ($LONG_MODELS, default
#   llama3-8b:4; $LONG_CONTEXTS, default 32768,131072); parity_long_xla: the same at
#   32K on xla, which must show mismatches. context_bench: bench_context.py at the
#   Llama-3-8B shape (32 layers), contexts 2K-32K, prefill tokens/s and MFU, decode
#   against the roofline, pallas and xla side by side at 8K; context_bench_128k: 128K
#   alone (one timed run). $LONG_OPTIONS / $CONTEXT_OPTIONS (option strings, e.g.
#   attn_skip_empty=1) with $LONG_TAG / $CONTEXT_TAG prove and time another setting;
#   $CONTEXT_LENS picks the contexts.
# - moe_cost, moe_parity, moe_e2e: the mixture of experts at the Qwen3-30B-A3B shape
#   (random weights), ~7 min for the three on one H200 (or one lane each on three GPUs:
#   `moe_cost :: moe_parity :: moe_e2e`). moe_cost: bench_moe.py, all 48 layers (~61 GB),
#   batch 1: one forward step at T = 1, 5, 2, 3, 8, 9, 17, 33 (pallas; xla at 1 and 5) and
#   the distinct experts each layer reads, against the roofline of the bytes read.
#   moe_parity: the parity matrix at 4 layers, context 2048 (the xla backend's dense
#   expansion of ragged_dot grows with the prefill's rows), trees of 8 and 32 nodes.
#   moe_e2e: bench_e2e.py, all 48 layers: serial (pallas) and oracle speculation with a
#   feature head (a = 0.8, 0.9; gamma 4 and the 8-node tree spine:5:1,0 at batch 1, gamma
#   4 at batch 8), parity checked. $MOE_PRESET, $MOE_LAYERS (a count; empty: all),
#   $MOE_BATCHES, $MOE_TS, $MOE_XLA_TS, $MOE_CONTEXT, $MOE_PARITY_LAYERS,
#   $MOE_PARITY_CONTEXT, $MOE_WINDOW, $MOE_KS, $MOE_TREES, $MOE_PROMPT, $MOE_NEW,
#   $MOE_E2E_BATCHES, $MOE_E2E_SHAPES, $MOE_TREE, $MOE_HEAD_VOCAB, $MOE_DRAFT (built, never
#   run: the feature head drafts), $MOE_DTYPE and
#   $MOE_INTERPRET (non-empty: Pallas interpret mode), $MOE_MXFP4 (non-empty: gpt-oss
#   experts kept MXFP4-packed; the matrix adds packed = dequantized) resize them ($MOE_OPTIONS: the
#   cost's and the matrix's kernel options, e.g. moe_layout_kernel=1 or mosaic (the
#   Mosaic GPU expert kernels), with $MOE_TAG naming their receipts;
#   $MOE_BACKENDS, default pallas:
#   add xla (pallas,xla, with MOE_PARITY_S=240) to show it breaking) (tests/test_moe_bench.py
#   runs the three at tiny-qwen3-moe on a CPU); $MOE_COST_S, $MOE_PARITY_S, $MOE_E2E_S
#   bound them. moe_mosaic: moe_parity on Mosaic GPU, then moe_cost at T = $MOE_TS
#   (default 1,5) on Triton and on Mosaic side by side ($MOE_MOSAIC_TAG names them).
# - groupsweep: tuning/sweep_grouped.py, the grouped expert kernels' tiles at the
#   Qwen3-30B-A3B shape ($GSWEEP_FLAGS), merged into the device copy's "grouped" table
#   of pallas_kernels/matmul_tuned.json so the lane's later steps (moe_parity first)
#   run with them; commit the table once the MoE matrix has proven it.
# - combinesweep: tuning/sweep_combine.py, the MoE combine kernel's tilings against the XLA
#   ops it replaces at 1 / 2 / 5 / 8 tokens, bits checked ($CSWEEP_FLAGS, $CSWEEP_S);
#   routesweep: tuning/sweep_route.py, route_kernel's rows a program and warps against the
#   jnp route at 1 / 5 / 40 rows ($RSWEEP_FLAGS, $RSWEEP_S).
# - profile: tuning/profile_step.py, the device kernels of one forward step of
#   $PROF_PRESET (default qwen3-30b-a3b) per kernel name, at block sizes $PROF_TS
#   (default 1,5), batch $PROF_BATCH (1), $PROF_LAYERS, $PROF_FLAGS (e.g.
#   "--context=32768 --max_len=40960": generate's bucketed cache at a 32K prompt);
#   $PROF_ROUNDS (e.g. 4; PROF_TS= skips the steps) adds speculative rounds of those
#   gammas with the feature head and without a drafter (`--round`, `--nodraft`; 0: an
#   adaptive run's plain decode rounds, `--decode_round`; serial: serial decoding's own
#   loop, `--serial_loop`). What a loop adds to a step, e.g. `PROF_PRESET=qwen3-8b
#   PROF_LAYERS=12 PROF_BATCH=64 PROF_TS=1 PROF_ROUNDS=0,serial profile`, then again with
#   XLA_FLAGS=--xla_gpu_enable_command_buffer= and PROF_TAG=nocmdbuf.
# - e2e_context: bench_e2e.py at the Llama-3-8B shape (32 layers), batch 1, prompts of
#   $CTX_LENS tokens (default 32768; 128K wants a call of its own and a prompt within the
#   model's 131,072 positions with the run's 133 after it: CTX_LENS=130816 CTX_ACCEPT=0.8,
#   four ~70 s prefills, the serial prefill's own timing left out: --noprefill_timing),
#   feature head at a = $CTX_ACCEPT (default 0.8,0.9) against serial, parity checked
#   (the draft preset is built, never run: the head drafts).
# - serial_split: split-KV without partials in memory (attn_serial_split, off by default):
#   bench_kernels steps after an 8K prompt with it on, checked bitwise against the
#   default; the long parity lane with it on; the prefill's time at 32K and 128K (~12 min).
# - tallsweep: tuning/sweep_schedule.py --tall, the schedules of launches of more than 64
#   rows (verify blocks at batch 32-64, prefill chunks), merged into the device copy's
#   pallas_kernels/matmul_tuned.json (a copy comes back in $OUT) so the lane's later steps
#   (parity first) run with them; commit the file once the matrix has proven it.
#   $TALL_SHAPES picks the weights (default the target's five; head_wqkv, head_fc and
#   head_lm_head are the feature head's own); $TALL_BM replaces the row tiles (default
#   64,128); $TALL_BK adds K tiles to the grid
#   (e.g. 64,128: bk is scheduling on the GPU, the sweep checks the bits); $TALL_FLAGS
#   passes more (e.g. "--nogrid --row_groups=2,3": today's schedule in row groups).
# - splitk_sweep: one weight ($SPLITK_NAME / $SPLITK_SHAPE, default w_down 12288,4096) on a
#   split-K config ($SPLITK_CONFIG bm,bn,bk,warps,stages,split; its other schedule entries
#   dropped, in this copy's table only), then sweep_schedule.py's tall tier with row groups
#   2 and 3 and its multi tier timed at 32 and 40 rows, each variant's bits against the
#   base's: whether split-K serves batch 32's steps without losing the 160-row verify.
# - prefillsweep: sweep_schedule.py --prefill, the compute-bound tiles of launches of more
#   than 1,024 rows (prefill chunks), bits at M = 1, 40, 160, 2048, time at 2048 and 8192,
#   merged like tallsweep's ($PREFILL_SHAPES, default the four weights a prefill runs;
#   $PREFILL_PRESET, default qwen3-8b: llama3-8b tunes bench_context's shapes).
# - sweep: tuning/sweep_matmul.py, the matmul tile tuning; it writes
#   $OUT/sweep_matmul[_tag]_tuned.json, and `tuned` merges those tables into the device copy's
#   pallas_kernels/matmul_tuned.json, so the lane's later steps run with it (commit the
#   file once the parity matrix has proven it).
# - e2e (up to 560 s) wants a call or lane of its own; e2e_b1 / e2e_b8 split it;
#   e2e_peers is the batch-1 peer set alone (through transformers' static-cache +
#   torch.compile run, which e2e_b1 reaches last); e2e_draftpallas runs the draft
#   model on the pallas backend (bench_e2e's default is xla: the draft never changes
#   the output); e2e_decompose times gamma 4 / a 0.8 with the draft on pallas, on xla
#   and left out (what a round costs besides the forwards). $E2E_FLAGS are appended
#   to e2e_b1 / e2e_b8 (e.g. "--options=plain --gammas=4 --accept=0.8") and $E2E_TAG
#   to their receipt names; $E2E_OPTIONS, $E2E_DRAFT_OPTIONS, $E2E_GAMMAS, $E2E_SEEDS,
#   $E2E_ACCEPT and $E2E_DRAFT_HEAD (no spaces, so lanes and steps can differ) become
#   --options, --draft_options, --gammas, --oracle_seeds, --accept and --draft_head;
#   $E2E_DRAFT replaces the draft preset (e.g. qwen3-0.6b:14, its first 14 layers).
# - kernels_fused: decode/verify steps with the speed options set otherwise
#   ($FUSED_OPTIONS, a bench_kernels --options list; default: plain, all four off),
#   timed device-side and checked bitwise against the default pallas step (all on);
#   $FUSED_S bounds the step (s), $FUSED_CONTEXT sets the context (default 512),
#   $FUSED_GAMMAS the verify blocks (default 4: T = 5), $FUSED_BATCHES the batches;
#   $FUSED_PRESET / $FUSED_LAYERS another shape, $FUSED_MXFP4=1 a gpt-oss preset's
#   experts kept packed (e.g. FUSED_OPTIONS=mxfp4_prmt=1: the PTX decode, bitwise).
# - train trains the code pair into $OUT/codepair; pair and pair_eval audit / evaluate
#   $PAIR, else a pair trained in this call, else the embedded one.
# - parity_trees: the parity matrix with tree verifies of 8-64 nodes ($PARITY_MODELS,
#   $PARITY_BACKENDS); kernels_trees: tree verify steps (16, 32 nodes) and a feature
#   head's step against decode at the Qwen3-8B shape, context 2048 ($TREE_SEEDS random
#   trees a size, $KERNEL_TREES sizes); tree_sweep: tuning/sweep_tree_attention.py, the
#   tree kernel's packed tiles against one token a tile (bits, time); main: the README's
#   main command with its defaults; pair_head: the code pair's draft model against its
#   feature head, chains and trees (real acceptance); e2e_session: Qwen3-8B serial and
#   oracle speculation (a = 0.8, 0.9, gamma 4) with the Qwen3-0.6B draft and with a feature
#   head, chains and a 32-node tree, batches 1 and 8 (~7-8 min). e2e_batch: fixed gamma 4
#   against adaptive round shapes ($E2E_ADAPTIVE, default gammas 0,1,2,4) side by side,
#   $E2E_DRAFTER (feature, or model with the draft $E2E_DRAFT, default qwen3-0.6b:1),
#   oracle a = $E2E_ACCEPT (default 0.8), prompt 512, 128 new tokens, batches $E2E_BATCHES
#   (default 1,8,16,32,64), the Qwen3-8B shape with 12 of its 36 layers ($E2E_TARGET, e.g.
#   qwen3-8b for all 36; 12 fit ~5-8 min with a compile per shape and batch); the receipt's
#   adaptive_stats say which shapes ran. chunk_cost:
#   tuning/chunk_cost.py at the same shape, batches $CHUNK_BATCHES (default 1,32,64): each
#   round shape's seconds against a chunk's rounds, and the engine's own probes after
#   warm_up (~80 s).
# - train_head trains a feature head for the embedded pair's target (train_draft_head.py,
#   the gpu preset: ~2 min on an H200) into $OUT/head (config.json, model.safetensors,
#   README.md, train_log.json); `eval_pair.py --head=$OUT/head` measures it. It reads
#   its config through ml-collections, which the H200 image lacks: carry the wheel.
# - parity: $PARITY_OPTIONS (a gpu_parity --options list) and $PARITY_TAG (receipt
#   suffix) prove another configuration, e.g. PARITY_OPTIONS=attn_split_rows=32.
# - parity_split: the parity matrix (pallas) with split-KV attention of another size
#   (attn_split=$ATTN_SPLIT, default 256 keys; the default path, which `parity`
#   proves, splits at 128 on a GPU); time it with `FUSED_OPTIONS=attn_split=256
#   kernels_fused` (its logits differ from the default's by design: the step reports
#   their largest difference instead of a bit check).
# - schedsweep: tuning/sweep_schedule.py, whether a matmul's bn / warps / stages change
#   its bits at M = 1 and 40 (row groups of 4) and which is fastest for the 40-row verify
#   block; $SCHED_S bounds it, $SCHED_FLAGS appended.
# - attnsweep: tuning/sweep_attention.py, whether split-KV attention's warps, stages and
#   V-tail masking change its bits (B = 1 and 8, T = 1 and 5) and which is fastest;
#   $ATTN_SWEEP_FLAGS appended, $ATTN_SWEEP_S bounds it.
# - a step NAME=value exports that variable for the lane's later steps, so lanes can
#   differ: `E2E_S=170 e2e_b1 :: E2E_S=300 e2e_b8`; one lane takes a quoted value with
#   spaces (`"GSWEEP_FLAGS=--max_candidates=15 --Ts=1,5"`), lanes only values without.
# - sweep: $SWEEP_FLAGS are appended (e.g. "--presets=qwen3-8b --max_candidates=24"),
#   $SWEEP_BUDGET (s) and $SWEEP_S (the step's limit) bound it.
# XLA_FLAGS set by the caller reach every step.
# With lanes (`::`), lane i runs on GPU i (CUDA_VISIBLE_DEVICES=i) in parallel, logs to
# $OUT/lane<i>.log, and every receipt is packed into $OUT/receipts.tgz at the end (only a
# few files travel back from a device call); one call alone packs them too when there
# are more than 8. Both only pack an $OUT that was empty when the call started.
# Each step has its own time limit so a slow one cannot eat the others'.
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the repository root
OUT=${OUT:-experiments/results}
# The card's short name in the receipts' tags (h200, h100, ...): nvidia-smi's, else h200.
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -o -i -E '\b[ABH][0-9]{2,3}\b' | head -1 | tr 'A-Z' 'a-z')}
GPU=${GPU:-h200}
PROF_TS=${PROF_TS-1,5}; PROF_ROUNDS=${PROF_ROUNDS:-}; PROF_PRESET=${PROF_PRESET:-qwen3-30b-a3b}
mkdir -p "$OUT"
# Packing (below) replaces $OUT's files by one archive: only for an $OUT that starts empty
# (a device call's), never for a folder of earlier receipts.
fresh_out=$([ -z "$(find "$OUT" -mindepth 1 -maxdepth 1 | head -1)" ] && echo 1 || echo "")
if [[ " $* " == *" :: "* ]]; then  # lanes: one per GPU, in parallel
  lanes=() cur=""
  for a in "$@"; do
    if [ "$a" = "::" ]; then lanes+=("$cur"); cur=""; else cur="$cur $a"; fi
  done
  lanes+=("$cur")
  for i in "${!lanes[@]}"; do
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$i GPU_SESSION_LANE=$i bash "$0" ${lanes[$i]} > "$OUT/lane$i.log" 2>&1 &
  done
  wait
  for i in "${!lanes[@]}"; do echo "##### lane $i (GPU $i):${lanes[$i]}"; cat "$OUT/lane$i.log"; done
  if [ -n "$fresh_out" ]; then
    tar -C "$OUT" -czf /tmp/receipts.tgz --exclude='lane*.log' . && mv /tmp/receipts.tgz "$OUT/"
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name receipts.tgz ! -name 'lane*.log' \
      -exec rm -rf {} +
  fi
  exit 0
fi
[ $# -gt 0 ] || set -- parity audit kernels spec
quiet() { grep -v -i -E "warn|libtpu|^I[0-9]{4}"; }
audit() {  # preset layers: pallas audit at 512..8192 and a 2048-token generation
  timeout "${AUDIT_S:-190}" python3 experiments/parity_audit.py --preset="$1" --layers="$2" \
    --contexts=512,2048,8192 --long_tokens=2048 --out="$OUT" --tag="${GPU}_$1" \
    2>&1 | quiet | grep -v "it/s" | tail -30
}
top_p() {  # tuning/mosaic_top_p.py: the Mosaic top-p's rows alone and among others
  timeout "${TOPP_S:-150}" python3 experiments/tuning/mosaic_top_p.py --tag=${GPU} --out="$OUT" \
    2>&1 | quiet | tail -8
}
pair_dir() { if [ -n "${PAIR:-}" ]; then echo "$PAIR";
             elif [ -d "$OUT/codepair" ]; then echo "$OUT/codepair";
             else echo jspec/assets/codepair; fi; }
for s in "$@"; do
  echo "=== $s"
  case $s in
    *=*) export "${s?}" ;;  # NAME=value sets a variable for the lane's later steps
    parity) timeout "${PARITY_S:-170}" python3 experiments/gpu_parity.py \
              --models="${PARITY_MODELS:-qwen3-8b:4,gemma3-4b:6}" --context=8192 --window=48 --options="${PARITY_OPTIONS:-}" --tag="${PARITY_TAG:-}" \
              --out="$OUT" 2>&1 | quiet | tail -40 ;;
    parity_long) timeout "${PARITY_S:-480}" python3 experiments/gpu_parity.py \
              --models="${LONG_MODELS:-llama3-8b:4}" --contexts="${LONG_CONTEXTS:-32768,131072}" \
              --window=48 --trees=16,32 --backends=pallas ${LONG_OPTIONS:+--options=$LONG_OPTIONS} \
              --tag="long${LONG_TAG:+_$LONG_TAG}" --out="$OUT" 2>&1 | quiet | tail -30 ;;
    parity_long_xla) timeout "${PARITY_S:-240}" python3 experiments/gpu_parity.py \
              --models="${LONG_MODELS:-llama3-8b:4}" --contexts=32768 --window=48 --trees=32 \
              --backends=xla --tag=long_xla --out="$OUT" 2>&1 | quiet | tail -12 ;;
    context_bench) timeout "${CONTEXT_S:-480}" python3 experiments/bench_context.py \
              --preset=llama3-8b --contexts="${CONTEXT_LENS:-2048,8192,32768}" --xla_contexts=8192 \
              --iters=2 ${CONTEXT_OPTIONS:+--options=$CONTEXT_OPTIONS} ${CONTEXT_TAG:+--tag=$CONTEXT_TAG} \
              --out="$OUT" 2>&1 | quiet | tail -12 ;;
    context_bench_128k) timeout "${CONTEXT_S:-480}" python3 experiments/bench_context.py \
              --preset=llama3-8b --contexts=131072 --xla_contexts= --iters=1 --tag=128k \
              --out="$OUT" 2>&1 | quiet | tail -8 ;;
    parity_split) timeout "${PARITY_S:-170}" python3 experiments/gpu_parity.py \
              --models=qwen3-8b:4,gemma3-4b:6 --context=8192 --window=48 --backends=pallas \
              --options="attn_split=${ATTN_SPLIT:-256}" --tag=split --out="$OUT" 2>&1 \
              | quiet | tail -30 ;;
    audit) audit qwen3-8b 4; audit gemma3-4b 6 ;;
    audit_qwen3) audit qwen3-8b 4 ;;
    audit_gemma3) audit gemma3-4b 6 ;;
    audit_xla) timeout 140 python3 experiments/parity_audit.py --preset=qwen3-8b --layers=4 \
              --backend=xla --expect_mismatch --contexts=512,2048 --long_tokens=512 \
              --out="$OUT" --tag=${GPU}_qwen3-8b_xla 2>&1 | quiet | tail -30 ;;
    train) timeout 330 python3 experiments/train_pair.py --time_limit_s=120 \
              --out_dir="$OUT/codepair" --workdir=/tmp/train_pair 2>&1 | quiet \
              | grep -v "it/s" | tail -30
           tar -C "$OUT" -czf "$OUT/codepair.tgz" codepair ;;  # safe even if later steps time out
    train_head) timeout 240 python3 experiments/train_draft_head.py \
              --config=configs/train_draft_head.py:gpu --config.out_dir="$OUT/head" \
              --config.workdir=/tmp/train_head 2>&1 | quiet | grep -v "it/s" | tail -30 ;;
    pair_eval) timeout 150 python3 experiments/eval_pair.py --pair="$(pair_dir)" \
              --gammas=1,2,3,4,6 --batch=1 --num_prompts=8 --peer_gammas=2,4 --iters=2 \
              --out="$OUT" --tag=${GPU}_b1 2>&1 | quiet | grep -v "it/s" | tail -30 ;;
    pair) P=$(pair_dir)
          timeout 130 python3 experiments/parity_audit.py --checkpoint="$P/target" \
              --contexts=512,2048 --long_tokens=1024 --out="$OUT" --tag=${GPU}_codepair \
              2>&1 | quiet | grep -v "it/s" | tail -30
          timeout 170 python3 experiments/eval_pair.py --pair="$P" --gammas=1,2,3,4,6 \
              --batch=1 --num_prompts=8 --peer_gammas=2,4 --iters=2 --out="$OUT" \
              --tag=${GPU}_b1 2>&1 | quiet | grep -v "it/s" | tail -30 ;;
    kernels) timeout 300 python3 experiments/bench_kernels.py --preset=qwen3-8b \
              --batches=1,8 --gammas=1,2,4,8 --context=512 --iters=10 --out="$OUT" \
              2>&1 | quiet | tail -60 ;;
    spec) timeout 500 python3 experiments/bench_speculative.py --target=qwen3-8b \
              --draft=qwen3-0.6b --prompt_len=512 --max_new_tokens=256 --batch=1 \
              --gammas=2,4,6,8 --oracle_gammas=2,4,6,8 --accept=0.5,0.7,0.8,0.9 --iters=3 \
              --out="$OUT" --tag=${GPU}_qwen3-8b_b1 2>&1 | quiet | tail -40 ;;
    sweep) timeout "${SWEEP_S:-210}" python3 experiments/tuning/sweep_matmul.py --out="$OUT" \
              --budget_s="${SWEEP_BUDGET:-150}" ${SWEEP_FLAGS:-} 2>&1 | quiet | tail -60 ;;
    e2e) timeout 560 python3 experiments/bench_e2e.py --target=qwen3-8b --draft=qwen3-0.6b \
              --batches=1,8 --prompt_len=512 --max_new_tokens=256 --out="$OUT" \
              2>&1 | quiet | tail -60 ;;
    e2e_b1|e2e_b8) B=${s#e2e_b}
           timeout "${E2E_S:-520}" python3 experiments/bench_e2e.py --target=qwen3-8b \
              --draft="${E2E_DRAFT:-qwen3-0.6b}" --batches="$B" --prompt_len=512 --max_new_tokens=256 \
              --out="$OUT" --tag="${GPU}_b$B${E2E_TAG:-}" ${E2E_FLAGS:-} \
              ${E2E_OPTIONS:+--options=$E2E_OPTIONS} \
              ${E2E_DRAFT_OPTIONS:+--draft_options=$E2E_DRAFT_OPTIONS} \
              ${E2E_GAMMAS:+--gammas=$E2E_GAMMAS} ${E2E_SEEDS:+--oracle_seeds=$E2E_SEEDS} \
              ${E2E_ACCEPT:+--accept=$E2E_ACCEPT} ${E2E_DRAFT_HEAD:+--draft_head=$E2E_DRAFT_HEAD} \
              2>&1 | quiet | grep -v "it/s" | tail -60 ;;
    e2e_peers) timeout "${E2E_S:-500}" python3 experiments/bench_e2e.py --target=qwen3-8b \
              --draft=qwen3-0.6b --batches=1 --prompt_len=512 --max_new_tokens=256 \
              --gammas=4 --accept=0.8 --nolookup --out="$OUT" --tag=${GPU}_b1_peers \
              2>&1 | quiet | grep -v "it/s" | tail -40 ;;
    e2e_decompose)  # the round's cost: draft on pallas, draft on xla, no draft at all
           for v in "pallas:--oracle_draft" "xla:--oracle_draft" "none:--nooracle_draft"; do
             timeout 150 python3 experiments/bench_e2e.py --target=qwen3-8b \
               --draft=qwen3-0.6b --batches=1 --prompt_len=512 --max_new_tokens=256 \
               --gammas=4 --accept=0.8 --nolookup --nopeers --iters=2 \
               --draft_backend="$([ "${v%%:*}" = xla ] && echo xla || echo pallas)" \
               "${v#*:}" --out="$OUT" --tag="${GPU}_b1_draft_${v%%:*}" 2>&1 | quiet \
               | grep -v "it/s" | tail -8
           done ;;
    e2e_draftpallas) timeout "${E2E_S:-300}" python3 experiments/bench_e2e.py --target=qwen3-8b \
              --draft=qwen3-0.6b --batches=1 --prompt_len=512 --max_new_tokens=256 \
              --gammas=2,4 --accept=0.8,0.9 --nolookup --nopeers --draft_backend=pallas \
              --out="$OUT" --tag=${GPU}_b1_draftpallas 2>&1 | quiet | grep -v "it/s" | tail -40 ;;
    groupsweep) timeout "${GSWEEP_S:-240}" python3 experiments/tuning/sweep_grouped.py --write \
              --out="$OUT" --preset="${MOE_PRESET:-qwen3-30b-a3b}" ${MOE_MXFP4:+--mxfp4} ${GSWEEP_FLAGS:-} 2>&1 | quiet | tail -12 ;;
    tuned) found=""  # every sweep's winners in $OUT (a --tag in $SWEEP_FLAGS names the file)
           for f in "$OUT"/sweep_matmul*_tuned.json; do
             [ -f "$f" ] || continue; found=1
             python3 -c "import json, sys; from pallas_kernels.matmul import write_tuned_rows; [print('dropped (new bits, sweep again):', d) for d in write_tuned_rows(json.load(open(sys.argv[1])))]" "$f"
             echo "merged into pallas_kernels/matmul_tuned.json:"; cat "$f"
           done
           [ -n "$found" ] || echo "no $OUT/sweep_matmul*_tuned.json: run sweep first" ;;
    kernels_fused) timeout "${FUSED_S:-280}" python3 experiments/bench_kernels.py \
              --preset="${FUSED_PRESET:-qwen3-8b}" ${FUSED_LAYERS:+--layers=$FUSED_LAYERS} \
              ${FUSED_MXFP4:+--mxfp4_experts} \
              --batches="${FUSED_BATCHES:-1,8}" --gammas="${FUSED_GAMMAS:-4}" \
              --context="${FUSED_CONTEXT:-512}" \
              --iters=10 --noops \
              --options=${FUSED_OPTIONS:-plain} \
              --out="$OUT" --tag=fused 2>&1 | quiet | tail -30 ;;
    serial_split) # attn_serial_split: steps after an 8K prompt (one unchunked forward, whose
              # split partials bound the context) bitwise against the default
              timeout 200 python3 experiments/bench_kernels.py --preset=llama3-8b --layers=4 \
                --batches=1,8 --gammas=4 --context=8192 --iters=5 --noops \
                --options=attn_serial_split=1 --out="$OUT" --tag=serial 2>&1 | quiet | tail -8
              timeout "${PARITY_S:-300}" python3 experiments/gpu_parity.py --models=llama3-8b:4 \
                --contexts=32768,131072 --window=48 --trees=16 --backends=pallas \
                --options=attn_serial_split=1 --tag=long_serial --out="$OUT" 2>&1 | quiet \
                | tail -14
              timeout "${CONTEXT_S:-300}" python3 experiments/bench_context.py --preset=llama3-8b \
                --contexts=32768,131072 --xla_contexts= --iters=1 --decode_steps=4 \
                --options=attn_serial_split=1 --tag=serial --out="$OUT" 2>&1 | quiet | tail -4 ;;
    schedsweep) timeout "${SCHED_S:-240}" python3 experiments/tuning/sweep_schedule.py --out="$OUT" \
              --budget_s="$(( ${SCHED_S:-240} - 60 ))" ${SCHED_FLAGS:-} 2>&1 | quiet \
              | grep -v "it/s" | tail -12 ;;
    tallsweep) timeout "${TALL_S:-330}" python3 experiments/tuning/sweep_schedule.py --tall \
              --shapes="${TALL_SHAPES:-w_gate_up:glu,w_down,lm_head,wqkv,wo}" --iters=3 \
              --bk="${TALL_BK:-}" --bm="${TALL_BM:-}" ${TALL_FLAGS:-} --out="$OUT" \
              --budget_s="$(( ${TALL_S:-330} - 60 ))" \
              --write=pallas_kernels/matmul_tuned.json 2>&1 | quiet | grep -v "it/s" | tail -14
              cp pallas_kernels/matmul_tuned.json "$OUT/" ;;
    splitk_sweep)  # a split-K base for one weight (this copy's table), then its tall tier
              # with row groups and its multi tier at 32 / 40 rows, bits against the base
              python3 - "${SPLITK_SHAPE:-12288,4096}" "${SPLITK_CONFIG:-16,128,128,4,4,2}" <<'PY'
import json, sys
path = "pallas_kernels/matmul_tuned.json"
K, N = map(int, sys.argv[1].split(","))
bm, bn, bk, warps, stages, split = map(int, sys.argv[2].split(","))
data = json.load(open(path))
other = lambda r: (r["K"], r["N"], r["dtype"]) != (K, N, "bfloat16")  # noqa: E731
for tier in [t for t in data if isinstance(data[t], list) and t != "grouped"]:
    data[tier] = [r for r in data[tier] if other(r)]
data["tuned"].append({"K": K, "N": N, "dtype": "bfloat16", "config": dict(
    bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages, split_k=split)})
json.dump(data, open(path, "w"), indent=1)
PY
              timeout "${SPLITK_S:-330}" python3 experiments/tuning/sweep_schedule.py --tall \
                --shapes="${SPLITK_NAME:-w_down}" --iters=3 --bm=64 --row_groups=2,3 \
                --budget_s="$(( ${SPLITK_S:-330} - 60 ))" --out="$OUT" \
                2>&1 | quiet | grep -v "it/s" | tail -10
              timeout "${SPLITK_MULTI_S:-150}" python3 experiments/tuning/sweep_schedule.py \
                --shapes="${SPLITK_NAME:-w_down}" --rows=1,32,40 --timed=32,40 --iters=5 \
                --budget_s="$(( ${SPLITK_MULTI_S:-150} - 40 ))" --out="$OUT" \
                2>&1 | quiet | grep -v "it/s" | tail -8 ;;
    prefillsweep) timeout "${PREFILL_SWEEP_S:-300}" python3 experiments/tuning/sweep_schedule.py \
              --prefill --preset="${PREFILL_PRESET:-qwen3-8b}" \
              --shapes="${PREFILL_SHAPES:-w_gate_up:glu,w_down,wqkv,wo}" --iters=3 \
              --budget_s="$(( ${PREFILL_SWEEP_S:-300} - 60 ))" --out="$OUT" \
              --write=pallas_kernels/matmul_tuned.json 2>&1 | quiet | grep -v "it/s" | tail -14
              cp pallas_kernels/matmul_tuned.json "$OUT/" ;;
    attnsweep) timeout "${ATTN_SWEEP_S:-300}" python3 experiments/tuning/sweep_attention.py --out="$OUT" \
              --budget_s="$(( ${ATTN_SWEEP_S:-300} - 60 ))" ${ATTN_SWEEP_FLAGS:-} 2>&1 | quiet \
              | grep -v "it/s" | tail -30 ;;
    parity_trees) timeout "${PARITY_S:-240}" python3 experiments/gpu_parity.py \
              --models="${PARITY_MODELS:-qwen3-8b:4,gemma3-4b:6}" --context=8192 --window=48 \
              --trees=8,16,32,64 --tree_seeds="${TREE_SEEDS:-1}" --backends=pallas \
              --tag=trees --out="$OUT" 2>&1 | quiet \
              | tail -40
           timeout 90 python3 experiments/gpu_parity.py --models=qwen3-8b:4 --context=8192 \
              --window=48 --trees=64 --backends=xla --tag=trees_xla --out="$OUT" 2>&1 \
              | quiet | tail -12 ;;
    kernels_trees) timeout "${KERNELS_S:-200}" python3 experiments/bench_kernels.py \
              --preset=qwen3-8b --batches=1 --gammas=0 --context=2048 --iters=10 --noops \
              --trees="${KERNEL_TREES:-16,32}" --head_vocab=32768 --out="$OUT" \
              --tag=trees 2>&1 | quiet \
              | tail -40 ;;
    tree_sweep) timeout "${TREE_SWEEP_S:-240}" python3 experiments/tuning/sweep_tree_attention.py \
              --out="$OUT" 2>&1 | quiet | grep -v "it/s" | tail -20 ;;
    main) timeout 100 python3 experiments/speculative_decode.py \
              --config=configs/speculative.py 2>&1 | quiet | tail -14 ;;
    pair_head) timeout "${PAIR_S:-150}" python3 experiments/eval_pair.py --pair="$(pair_dir)" \
              --drafters=model,feature --gammas=2,4 --batch=1 --num_prompts=8 --iters=2 \
              --policies=exact_greedy --trees="dynamic:6,60,4" --nopeers \
              --out="$OUT" --tag=${GPU}_b1_head 2>&1 | quiet | grep -v "it/s" | tail -30 ;;
    e2e_session) timeout "${E2E_S:-470}" python3 experiments/bench_e2e.py --target=qwen3-8b \
              --draft=qwen3-0.6b --batches="${E2E_BATCHES:-1,8}" --prompt_len=512 \
              --max_new_tokens=256 --gammas=4 --accept=0.8,0.9 --drafter=model,feature \
              --tree=";spine:8:4,3,3,2,2,1,1,0" --rank_probs=0.1 --nolookup --nopeers \
              --batch_shapes="1:model/;1:feature/;1:feature/spine:8:4,3,3,2,2,1,1,0;8:feature/" \
              --serial_backends=pallas --iters=2 --out="$OUT" --tag=${GPU}_session \
              2>&1 | quiet | grep -v "it/s" | tail -40 ;;
    e2e_batch) timeout "${E2E_S:-540}" python3 experiments/bench_e2e.py --target="${E2E_TARGET:-qwen3-8b:12}" \
              --draft="${E2E_DRAFT:-qwen3-0.6b:1}" --drafter="${E2E_DRAFTER:-feature}" \
              --batches="${E2E_BATCHES:-1,8,16,32,64}" --prompt_len=512 --max_new_tokens=128 \
              --gammas=4 --accept="${E2E_ACCEPT:-0.8}" \
              --adaptive="${E2E_ADAPTIVE:-0,1,2,4}" --nolookup --nopeers \
              --serial_backends=pallas --iters=2 ${E2E_FLAGS:-} \
              --out="$OUT" --tag="${GPU}_adaptive${E2E_TAG:-}" 2>&1 | quiet | grep -v "it/s" | tail -30 ;;
    e2e_context) for ctx in ${CTX_LENS:-32768}; do  # speculative speedup at depth (37.4)
                timeout "${E2E_CTX_S:-540}" python3 experiments/bench_e2e.py --target=llama3-8b \
                  --draft=tiny-qwen3:1 --drafter=feature --head_vocab=16384 --batches=1 \
                  --prompt_len="$ctx" --max_new_tokens=128 --gammas=4 --accept="${CTX_ACCEPT:-0.8,0.9}" \
                  --nolookup --nopeers --serial_backends=pallas --iters=1 --noprefill_timing \
                  --out="$OUT" --tag="${GPU}_ctx$ctx" 2>&1 | quiet | grep -v "it/s" | tail -10
              done ;;
    moe_cost) timeout "${MOE_COST_S:-150}" python3 experiments/bench_moe.py \
              --preset="${MOE_PRESET:-qwen3-30b-a3b}" --layers="${MOE_LAYERS:-0}" \
              --batches="${MOE_BATCHES:-1}" --Ts="${MOE_TS:-1,5,2,3,8,9,17,33}" \
              --other_Ts=1,5 --xla_Ts="${MOE_XLA_TS-1,5}" --context="${MOE_CONTEXT:-512}" \
              --iters=5 --dtype="${MOE_DTYPE:-bfloat16}" ${MOE_INTERPRET:+--interpret} \
              ${MOE_OPTIONS:+--options=$MOE_OPTIONS} ${MOE_MXFP4:+--mxfp4_experts} \
              --out="$OUT" --tag="${GPU}${MOE_TAG:+_$MOE_TAG}" 2>&1 | quiet | tail -30 ;;
    chunk_cost) timeout "${CHUNK_S:-300}" python3 experiments/tuning/chunk_cost.py \
              --batches="${CHUNK_BATCHES:-1,32,64}" --out="$OUT" --tag=${GPU} 2>&1 | quiet | tail -24 ;;
    profile) for t in ${PROF_TS//,/ }; do
              timeout "${PROF_S:-150}" python3 experiments/tuning/profile_step.py \
              --preset="$PROF_PRESET" --T="$t" --batch="${PROF_BATCH:-1}" \
              ${PROF_LAYERS:+--layers=$PROF_LAYERS} ${PROF_FLAGS:-} ${MOE_MXFP4:+--mxfp4_experts} \
              --tag="${GPU}_B${PROF_BATCH:-1}_T$t${PROF_TAG:+_$PROF_TAG}" --out="$OUT" 2>&1 | quiet | tail -34; done
            for g in ${PROF_ROUNDS//,/ }; do  # speculative rounds, with and without the head
              if [ "$g" = serial ]; then  # serial decoding's loop
                timeout "${PROF_S:-150}" python3 experiments/tuning/profile_step.py \
                --preset="$PROF_PRESET" --serial_loop --batch="${PROF_BATCH:-1}" \
                ${PROF_LAYERS:+--layers=$PROF_LAYERS} ${PROF_FLAGS:-} \
                --tag="${GPU}_B${PROF_BATCH:-1}_serial${PROF_TAG:+_$PROF_TAG}" \
                --out="$OUT" 2>&1 | quiet | tail -24; continue; fi
              for d in draft nodraft; do
                timeout "${PROF_S:-150}" python3 experiments/tuning/profile_step.py \
                --preset="$PROF_PRESET" "$([ "$g" = 0 ] && echo --decode_round || echo --round="$g")" \
                --"$d" --batch="${PROF_BATCH:-1}" \
                ${PROF_LAYERS:+--layers=$PROF_LAYERS} ${PROF_FLAGS:-} \
                --tag="${GPU}_B${PROF_BATCH:-1}_round$g${d#draft}${PROF_TAG:+_$PROF_TAG}" \
                --out="$OUT" 2>&1 | quiet | tail -24; done; done ;;
    profile_prefill) for low in ${PP_LOWERINGS:-triton mosaic}; do  # a prompt's prefill
              timeout "${PROF_S:-150}" python3 experiments/tuning/profile_step.py \
              --preset="${PP_PRESET:-qwen3-8b}" --prefill --context="${PP_CONTEXT:-512}" \
              --options="$low" --tag="${GPU}_prefill${PP_CONTEXT:-512}_$low${PROF_TAG:+_$PROF_TAG}" \
              --out="$OUT" 2>&1 | quiet | tail -22; done ;;
    combinesweep) timeout "${CSWEEP_S:-150}" python3 experiments/tuning/sweep_combine.py \
              ${CSWEEP_FLAGS:-} --out="$OUT" --tag=${GPU} 2>&1 | quiet | grep -v "it/s" | tail -20 ;;
    mosaic) timeout "${MOSAIC_PARITY_S:-330}" python3 experiments/gpu_parity.py \
              --models="${MOSAIC_MODELS:-qwen3-8b:4,gemma3-4b:6}" --context=8192 --window=48 \
              --batches=4,32 --trees="${MOSAIC_TREES:-8,16,32,64}" --backends=pallas \
              --options="${MOSAIC_OPTIONS:-mosaic}" --tag="mosaic${MOSAIC_TAG:+_$MOSAIC_TAG}" \
              --out="$OUT" 2>&1 | quiet | tail -40
            [ "${MOSAIC_TOPP:-1}" = 1 ] && top_p
            for ctx in ${MOSAIC_CONTEXTS:-512 8192}; do
              timeout "${MOSAIC_KERNELS_S:-150}" python3 experiments/bench_kernels.py \
                --preset=qwen3-8b --batches=1,8 --gammas=4,16 --context="$ctx" --iters=5 \
                --options="${MOSAIC_OPTIONS:-mosaic}" --noops \
                --tag="mosaic${MOSAIC_TAG:+_$MOSAIC_TAG}_ctx$ctx" --out="$OUT" 2>&1 \
                | quiet | tail -16
            done ;;
    mosaic_unfused) timeout "${MOSAIC_PARITY_S:-240}" python3 experiments/gpu_parity.py \
              --models="${MOSAIC_MODELS:-qwen3-8b:4}" --context=8192 --window=48 --batches=4,32 \
              --trees="${MOSAIC_TREES:-8,32}" --backends=pallas --options=mosaic+no_fuse_glu \
              --row_partials=2 --tag="mosaic_unfused-rp2${MOSAIC_TAG:+_$MOSAIC_TAG}" \
              --out="$OUT" 2>&1 | quiet | tail -30
            timeout "${MOSAIC_KERNELS_S:-200}" python3 experiments/bench_kernels.py \
              --preset=qwen3-8b --layers=4 --batches=1,8 --gammas=4,16 --context=512 --iters=3 \
              --noops --options=mosaic,mosaic+no_fuse_glu --tag="mosaic_unfused" --out="$OUT" \
              2>&1 | quiet | tail -20 ;;
    e2e_mosaic) for low in triton mosaic; do  # serial and speculative, the two lowerings
              opts=$low; [ $low = mosaic ] && opts=${MOSAIC_OPTIONS:-mosaic}
              timeout "${E2E_S:-270}" python3 experiments/bench_e2e.py --target=qwen3-8b \
                --draft=qwen3-0.6b:1 --drafter=feature --batches="${E2E_BATCHES:-1,8}" \
                --prompt_len=512 --max_new_tokens=128 --gammas=4 --accept=0.8 --nolookup \
                --nopeers --serial_backends=pallas --iters=2 --options="$opts" \
                --out="$OUT" --tag="${GPU}_lowering-$low" 2>&1 | quiet | grep -v "it/s" | tail -14
            done ;;
    moe_mosaic) # the MoE on Mosaic GPU: its matrix, then a step beside Triton's (one call)
              MOE_OPTIONS=mosaic MOE_TAG=mosaic${MOE_MOSAIC_TAG:+-$MOE_MOSAIC_TAG} \
                bash "$0" moe_parity | tail -n +2
              for low in triton mosaic; do
                MOE_OPTIONS=$low MOE_TAG=$low${MOE_MOSAIC_TAG:+-$MOE_MOSAIC_TAG} \
                MOE_TS=${MOE_TS:-1,5} MOE_XLA_TS= bash "$0" moe_cost | tail -n +2; done ;;
    loop_cmdbuf) for cb in default while; do  # the host loop's while in a command buffer
              flags=${XLA_FLAGS:-}
              [ $cb = while ] && flags="$flags --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
              XLA_FLAGS="$flags" timeout "${E2E_S:-200}" python3 experiments/bench_e2e.py \
                --target="${E2E_TARGET:-qwen3-8b}" --draft=qwen3-0.6b:1 --drafter=feature \
                --batches="${E2E_BATCHES:-1}" --prompt_len=512 --max_new_tokens=128 --gammas=4 \
                --accept=0.8 --nolookup --nopeers --serial_backends=pallas --iters=2 \
                --out="$OUT" --tag="${GPU}_cmdbuf-$cb" 2>&1 | quiet | grep -v "it/s" | tail -10
            done ;;
    mosaic_top_p) top_p ;;
    table) cp pallas_kernels/matmul_tuned.json "$OUT/" ;;  # the device copy's tile table
    mosaic_swapped) timeout "${MSW_S:-270}" python3 experiments/tuning/mosaic_matmul.py \
              --swapped --noplain_bits --rows="${MSW_ROWS:-1,16,17,40,64,160}" --iters=10 \
              --alone="${MSW_ALONE:-0,1,7,8,15,16,31,63,64,100}" ${MSW_MODEL:+--model=$MSW_MODEL} \
              ${MSW_SHAPES:+--shapes=$MSW_SHAPES} \
              $([ -z "${MSW_SHAPES:-}${MSW_MODEL:-}" ] && echo --shapes=wqkv,w_gate_up,w_down,wo,lm_head) \
              --configs="${MSW_CONFIGS:-s:128:6,s:128:6:10,s:128:6:10:w}" --budget_s="${MSW_BUDGET:-200}" \
              --write=pallas_kernels/mosaic/matmul_tuned.json --tag=${GPU}_swapped${MSW_TAG:+_$MSW_TAG} \
              --out="$OUT" 2>&1 | quiet | tail -40
            cp pallas_kernels/mosaic/matmul_tuned.json "$OUT/mosaic_matmul_tuned.json" 2>/dev/null ;;
    mosaic_prefill) timeout "${MPF_S:-240}" python3 experiments/tuning/mosaic_matmul.py \
              --noplain_bits --rows=1,17,512,2048 --alone=0,1,511 --iters=10 \
              --shapes="${MPF_SHAPES:-wqkv,w_gate_up,w_down,wo}" \
              --configs="${MPF_CONFIGS:-64:128:4,128:128:4,256:128:2}" \
              --budget_s="${MPF_BUDGET:-180}" --tag=${GPU}_prefill --out="$OUT" \
              --write_prefill=pallas_kernels/mosaic/matmul_tuned.json 2>&1 | quiet | tail -40
            cp pallas_kernels/mosaic/matmul_tuned.json "$OUT/mosaic_matmul_tuned.json" 2>/dev/null ;;
    mosaic_ws) timeout "${MPW_S:-300}" python3 experiments/tuning/mosaic_prefill.py \
              --shapes="${MPW_SHAPES:-wqkv,w_gate_up,w_down,wo}" ${MPW_FLAGS:-} \
              --budget_s="${MPW_BUDGET:-200}" --tag=${GPU}${MPW_TAG:+_$MPW_TAG} --out="$OUT" \
              --write=pallas_kernels/mosaic/matmul_tuned.json 2>&1 | quiet | tail -24
            cp pallas_kernels/mosaic/matmul_tuned.json "$OUT/mosaic_matmul_tuned.json" 2>/dev/null ;;
    mosaic_attention) timeout "${MATT_S:-240}" python3 experiments/tuning/mosaic_attention.py \
              ${MATT_FLAGS:-} --out="$OUT" --tag=${GPU} 2>&1 | quiet | tail -8 ;;
    routesweep) timeout "${RSWEEP_S:-120}" python3 experiments/tuning/sweep_route.py \
              ${RSWEEP_FLAGS:-} --out="$OUT" --tag=${GPU} 2>&1 | quiet | grep -v "it/s" | tail -14 ;;
    moe_parity) timeout "${MOE_PARITY_S:-200}" python3 experiments/gpu_parity.py \
              --models="${MOE_PRESET:-qwen3-30b-a3b}:${MOE_PARITY_LAYERS:-4}" \
              --context="${MOE_PARITY_CONTEXT:-2048}" --window="${MOE_WINDOW:-48}" \
              --ks="${MOE_KS:-1,2,4,8,16,32}" --trees="${MOE_TREES:-8,32}" \
              --dtype="${MOE_DTYPE:-bfloat16}" ${MOE_INTERPRET:+--interpret} --tag="moe${MOE_TAG:+_$MOE_TAG}" \
              ${MOE_OPTIONS:+--options=$MOE_OPTIONS} --backends="${MOE_BACKENDS:-pallas}" \
              ${MOE_MXFP4:+--mxfp4_experts} --out="$OUT" 2>&1 | quiet | tail -24 ;;
    moe_e2e) timeout "${MOE_E2E_S:-165}" python3 experiments/bench_e2e.py \
              --target="${MOE_PRESET:-qwen3-30b-a3b}${MOE_LAYERS:+:$MOE_LAYERS}" \
              --draft="${MOE_DRAFT:-qwen3-0.6b:1}" --drafter=feature \
              --head_vocab="${MOE_HEAD_VOCAB:-32768}" \
              --batches="${MOE_E2E_BATCHES:-1,8}" --prompt_len="${MOE_PROMPT:-512}" \
              --max_new_tokens="${MOE_NEW:-256}" --gammas=4 --accept=0.8,0.9 \
              --tree=";${MOE_TREE:-spine:5:1,0}" --rank_probs=0.1 \
              --batch_shapes="${MOE_E2E_SHAPES:-1:feature/;1:feature/${MOE_TREE:-spine:5:1,0};8:feature/}" \
              --nolookup --nopeers --serial_backends=pallas --iters=2 \
              --dtype="${MOE_DTYPE:-bfloat16}" ${MOE_MXFP4:+--mxfp4_experts} \
              --out="$OUT" --tag=${GPU}_moe 2>&1 | quiet \
              | grep -v "it/s" | tail -24 ;;
    *) echo "unknown step $s" ;;
  esac
done
# Many small files do not travel back well: pack the trained pair into one archive.
if [ -d "$OUT/codepair" ]; then
  tar -C "$OUT" -czf "$OUT/codepair.tgz" codepair && rm -rf "$OUT/codepair"
fi
# A device call brings back at most 8 files: with more, one call alone (not a lane, which
# the lanes' end packs) packs them all into receipts.tgz.
if [ -n "$fresh_out" ] && [ -z "${GPU_SESSION_LANE:-}" ] \
    && [ "$(find "$OUT" -mindepth 1 -maxdepth 1 | wc -l)" -gt 8 ]; then
  tar -C "$OUT" -czf /tmp/receipts.tgz . && mv /tmp/receipts.tgz "$OUT/"
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name receipts.tgz -exec rm -rf {} +
fi
true
