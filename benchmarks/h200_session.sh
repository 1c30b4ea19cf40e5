#!/usr/bin/env bash
# The measurements still owed on the lent H200, one step per device call (each fits the
# 10-minute limit), in the order of what they unblock. Run after the two staging calls of
# ../shared/gpu/README.md, from the repository root, with $OUT set by the device tool:
#
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
#   bash benchmarks/h200_session.sh tests      # gpu-marked tests written without a GPU first
#   bash benchmarks/h200_session.sh suite [NAMES]  # issue 21: real exports vs torch.compile
#        (nine models and their torch.compile runs do not fit one 10-minute call: run
#        `suite cnn`, `suite transformers`, `suite rest` -- groups of the default list)
#   bash benchmarks/h200_session.sh kernels    # GPU tests of the kernels being decided, and the
#        attention kernels alone against torch's SDPA
#   bash benchmarks/h200_session.sh hopper     # the Hopper GEMM variants' GPU value tests alone
#   bash benchmarks/h200_session.sh epilogue   # `hopper`, then `verify` narrowed to fit the same call
#   bash benchmarks/h200_session.sh verify     # the Hopper GEMM variants (two CTAs an SM,
#        persistent, both) against the default on the models still above torch.compile, with
#        profiles; VERIFY_MODELS / VERIFY_VARIANTS pick them
#   bash benchmarks/h200_session.sh tune 1|2   # issue 21: amp tune on TUNE_MODEL (yolo_head), then
#        its tuned build timed beside the default and torch.compile
#   bash benchmarks/h200_session.sh dynamic    # issue 22: dynamic vs static builds
#   bash benchmarks/h200_session.sh dynboth    # issue 22: BERT and the CNN with their variants, one call
#   bash benchmarks/h200_session.sh dynprof    # issue 22: the dynamic CNN's kernels against a static build's at batch 32
#   bash benchmarks/h200_session.sh quick      # the newest mechanisms' GPU tests and A/Bs, one call
#   bash benchmarks/h200_session.sh corpus NAMES [NAMES...]  # issue 20: corpus rows on cuda
#        (fp16,bf16; each NAMES group exported and run in parallel with the others)
#
# Each step prints a short table last and leaves full logs / JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/amp-out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
step=${1:-}
shift || true

case "$step" in
  tests)
    # fused attention (masks, padding, bf16, NaN guard, symbolic B/S), symbolic-M GEMMs, and
    # the three tests that failed
    # on 2026-12-04 without a recorded cause (docs/reliability.md)
    # each test builds its own kernels (CPU-bound): spread them over the cores when
    # pytest-xdist is there (stage it with the other wheels)
    par=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
    timeout 560 "$PY" -m pytest -m gpu -q --tb=short -p no:cacheprovider $par \
      --junitxml="$OUT/gpu_tests.xml" \
      tests/backends/cuda/test_fused_attention.py \
      "tests/backends/cuda/test_cuda_safe_names.py::test_hostile_names_run_on_gpu" \
      "tests/backends/test_odd_sizes.py::test_odd_pt2_on_gpu" \
      tests/backends/cuda/test_exact_pow.py \
      "tests/backends/cuda/test_tc_gemm.py::test_symbolic_m_gemm_matches_fp32_reference_at_every_m" \
      "tests/backends/cuda/test_hopper_gemm.py::test_symbolic_rows_over_a_range_match_float64" \
      "tests/backends/cuda/test_hopper_gemm.py::test_fused_tail_matches_float64" \
      tests/backends/cuda/test_hopper_gemm.py::test_two_per_sm_matches_float64 \
      tests/backends/cuda/test_hopper_gemm.py::test_persistent_matches_float64 \
      tests/backends/cuda/test_hopper_gemm.py::test_symbolic_rows_persistent_match_float64 \
      "tests/backends/cuda/test_conv_gemm.py::test_wide_pointwise_convs_on_gpu" \
      "tests/backends/cuda/test_conv_gemm.py::test_symbolic_batch_convs_on_gpu" \
      "tests/backends/cuda/test_norm_cast.py::test_symbolic_rows_match_float64_on_gpu" \
      "tests/backends/cuda/test_tc_gemm.py::test_tile_variants_match_fp32_reference_on_both_sides_of_each_step" \
      "tests/backends/cuda/test_conv_gemm.py::test_symbolic_batch_convs_on_gpu" \
      "tests/test_dynamic.py::test_bert_on_gpu_with_graphs_on_the_capture_grid" \
      "tests/test_dynamic.py::test_bert_on_gpu_at_every_shape_with_graphs_per_shape" \
      "tests/backends/cuda/test_injective.py::test_symbolic_gather_matches_numpy_at_every_batch" \
      tests/backends/cuda/test_nonfinite_const.py tests/frontend/test_ort_session.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -60
    ;;
  suite)
    group=${1:-cnn}
    shift || true
    case "$group" in
      cnn) corpus=resnet50,mobilenet_v3_large,efficientnet_b0,convnext_tiny; hand='' ;;
      transformers) corpus=vit_b_16,bert,gpt2; hand='' ;;
      rest) corpus=yolo_head,whisper_encoder; hand=resnet50,bert-large ;;
      *) corpus=$group; hand='' ;;
    esac
    # a file name the device tool brings back: no commas (a list of models as the group)
    tag=$(printf '%s' "$group" | tr -c 'A-Za-z0-9_.-' '_')
    timeout 590 "$PY" benchmarks/gpu_suite.py --models "$hand" --corpus "$corpus" \
      --amp-precisions fp16,bf16 --budget-s 400 --jobs 8 --json "$OUT/gpu_suite_$tag.json" \
      "$@" 2>&1 | tee "$OUT/gpu_suite_$tag.log" | tail -60
    ;;
  kernels)
    # the newest kernels alone: GPU tests of the mma.sync attention and the narrow GEMM tiles
    # (49 passed on the H100, 2026-12-07), then the attention kernels against torch's SDPA at
    # the suite's shapes
    par=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
    timeout 200 "$PY" -m pytest -m gpu -q --tb=short -p no:cacheprovider $par \
      --junitxml="$OUT/kernel_tests.xml" tests/backends/cuda/test_fused_attention.py \
      tests/backends/cuda/test_tc_gemm.py tests/backends/cuda/test_hopper_gemm.py \
      -k "mma or narrow or short_k or symbolic" 2>&1 | tail -8
    timeout 150 "$PY" benchmarks/attention_bench.py --json "$OUT/attention_bench.json" \
      --shapes "8,12,1500,64;8,12,197,64;8,12,128,64;8,12,512,64" --number 10 --repeat 10 \
      2>&1 | tail -14
    ;;
  hopper)
    # the Hopper GEMM variants' GPU value tests alone (two CTAs an SM, persistent): run before
    # `verify` times them, with a short limit (a kernel whose barriers deadlock hangs)
    timeout 240 "$PY" -m pytest -m gpu -q --tb=short -p no:cacheprovider \
      --junitxml="$OUT/hopper_tests.xml" tests/backends/cuda/test_hopper_gemm.py \
      -k "two_per_sm or persistent" 2>&1 | tail -8
    ;;
  epilogue)
    # `hopper` and a narrowed `verify` in one call, for a session with ~8 minutes of device
    # time: the variants are timed only if their float64 tests pass
    bash "$0" hopper && VERIFY_MODELS=${VERIFY_MODELS:-whisper_encoder,vit_b_16,convnext_tiny} \
      VERIFY_BUDGET_S=${VERIFY_BUDGET_S:-300} timeout 420 bash "$0" verify --no-profile "$@"
    ;;
  verify)
    # issue 21's open A/Bs, one run: the fixes for the Hopper GEMM's exposed epilogue
    # (docs/gpu-performance.md, "The Hopper GEMM's epilogue is exposed") -- two CTAs an SM
    # (cuda.hopper_two_per_sm: the epilogue of one under the main loop of the other),
    # persistent kernels (cuda.hopper_persistent: the next tile's loads under the epilogue)
    # and both -- on the models above torch.compile. (Its earlier A/Bs, hopper-short-k and
    # mma-attention-wide, were timed on 2026-12-07 and stay off.) VERIFY_MODELS picks the
    # models, VERIFY_VARIANTS the variants (files in benchmarks/variants).
    V=benchmarks/variants
    models=${VERIFY_MODELS:-whisper_encoder,vit_b_16,convnext_tiny,yolo_head}
    vs=${VERIFY_VARIANTS:-hopper-two-per-sm hopper-persistent hopper-persistent-two-per-sm}
    variants=()
    for m in ${models//,/ }; do
      for v in $vs; do variants+=(--variant "$m.dynamo:${v#hopper-}=$V/$v.yaml"); done
    done
    timeout 580 "$PY" benchmarks/gpu_suite.py --models '' --corpus "$models" \
      --torch-modes reduce-overhead --amp-precisions fp16 --jobs 8 \
      --budget-s "${VERIFY_BUDGET_S:-420}" --json "$OUT/verify_suite.json" \
      "${variants[@]}" "$@" 2>&1 | tee "$OUT/verify_suite.log" | tail -30
    ;;
  quick)
    # one call when the device budget allows only one: the Hopper GEMMs' new GPU value tests
    # (short K, symbolic rows), BERT's dynamic library with and without the symbolic-row
    # Hopper kernels beside static builds at batch 1/8/32, and the two-CTAs-an-SM A/B on two
    # models
    # (no per-kernel profiles)
    par=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
    timeout 90 "$PY" -m pytest -m gpu -q --tb=short -p no:cacheprovider $par \
      --junitxml="$OUT/quick_tests.xml" tests/backends/cuda/test_hopper_gemm.py \
      -k "short_k or symbolic" 2>&1 | tail -6
    # the dynamic and verify steps themselves, cut to fit: BERT only, two CNNs, no profiles
    timeout 290 bash "$0" dynamic --models bert --batches 1,8,32 --jobs 5 --repeat 30 \
      --warmup 5 | tail -16
    VERIFY_MODELS=convnext_tiny,vit_b_16 VERIFY_BUDGET_S=150 timeout 190 bash "$0" verify \
      --no-profile | tail -14
    ;;
  tune)
    # issue 21's `amp tune` evidence, in two calls (each under the 10-minute limit):
    #   tune 1   export TUNE_MODEL (default yolo_head, one of the models above torch.compile)
    #            as the suite exports it, and tune it for TUNE_BUDGET (default 6m)
    #   tune 2   amp fp16 with and without the records beside torch.compile, one invocation
    # (the export is seeded, so the second call's export matches the tuned workloads)
    m=${TUNE_MODEL:-yolo_head}
    w=/tmp/amp-tune-$m
    if [ "${1:-1}" = 1 ]; then
      timeout 240 "$PY" benchmarks/gpu_suite.py --models '' --corpus "$m" --build-only \
        --amp-precisions fp16 --no-torch --no-profile --workdir "$w" > "$OUT/tune_export.log" 2>&1
      timeout 480 "$PY" -m amp_cli tune "$w/$m.dynamo.onnx" --db "$w/db" --target cuda \
        --time-budget "${TUNE_BUDGET:-6m}" --trials 4000 2>&1 | tee "$OUT/tune.log" | tail -20
      cp "$w/db/summary.json" "$OUT/tune_summary.json" 2>/dev/null
    else
      timeout 560 "$PY" benchmarks/gpu_suite.py --models '' --corpus "$m" \
        --amp-precisions fp16 --torch-modes reduce-overhead --tuning-db "$w/db" --workdir "$w" \
        --json "$OUT/tune_suite.json" 2>&1 | tee "$OUT/tune_suite.log" | tail -20
    fi
    ;;
  dynamic)
    # the default dynamic build against static ones, and GEMMs over symbolic rows on amp's
    # wmma tiles instead of the Hopper kernels (cuda.hopper_symbolic_m off) as a variant; the
    # build with the optimum copy is left out for time (dynboth times it)
    timeout 590 "$PY" benchmarks/dynamic_bench.py --json "$OUT/dynamic_bench.json" \
      --no-copy-ab --variant no-hopper-symbolic=benchmarks/variants/no-hopper-symbolic.yaml "$@" \
      2>&1 | tee "$OUT/dynamic_bench.log" | tail -40
    ;;
  dynboth)
    # issue 22 in one call, no profiles: BERT and the CNN, static b1/b8/b32 against the
    # default dynamic build (on CUDA without the optimum copy since 2026-12-07 evening: the
    # copy is one static build inside the dynamic one, which put the CNN's build over 2x) and
    # the same with the copy ("dynamic + copy", dynamic_bench's A/B build; BERT without it is
    # this step's first question), the CNN also with its wmma tile variants only up to the
    # optimum (variants-to-optimum.yaml: 1.26-1.38x a static build on the 2-core machine; its
    # latency is the second question).
    V=benchmarks/variants
    timeout "${DYN_TIMEOUT_S:-560}" "$PY" benchmarks/dynamic_bench.py --models bert,cnn \
      --workdir /tmp/amp-dynprof --jobs 8 --repeat 30 --warmup 5 \
      --json "$OUT/dynboth_bench.json" \
      --variant "cnn:to-opt=$V/variants-to-optimum.yaml" "$@" 2>&1 \
      | tee "$OUT/dynboth_bench.log" | tail -24
    ;;
  dynprof)
    # why the dynamic CNN is slower than a static build at batch 32 (1.39x on 2026-12-05):
    # the CNN's static b1/b8/b32, default dynamic and + copy builds timed, then both
    # b32 libraries' kernels profiled (benchmarks/kernel_profile.py) at batch 32; the tiles
    # chosen without weighing their padding (cuda.padding_aware_tiles off) as a variant
    w=/tmp/amp-dynprof
    timeout 400 "$PY" benchmarks/dynamic_bench.py --models cnn --workdir "$w" --jobs 6 \
      --repeat 30 --warmup 5 --json "$OUT/dynprof_bench.json" \
      --variant no-pad-aware=benchmarks/variants/no-padding-aware-tiles.yaml "$@" 2>&1 \
      | tee "$OUT/dynprof_bench.log" | tail -14
    for kind in "static b32" "dynamic" "dynamic no-pad-aware"; do
      lib=$("$PY" -c 'import json,sys; b=[b for b in json.load(open(sys.argv[1]))["builds"]
if b["kind"] == sys.argv[2]]; print(b[0]["out"] + "/model.so" if b else "")' \
        "$OUT/dynprof_bench.json" "$kind")
      [ -n "$lib" ] && [ -f "$lib" ] || { echo "no $kind library"; continue; }
      tag=$(printf '%s' "$kind" | tr -c 'A-Za-z0-9' '_')
      mkdir -p "$OUT/$tag"; echo "== $kind at batch 32"
      OUT="$OUT/$tag" timeout 90 "$PY" benchmarks/kernel_profile.py "$lib" "$w/cnn.onnx" \
        --input-shape input:32x3x224x224 --top 12 2>&1 | tail -16
    done
    ;;
  corpus)
    # each argument is a group of model names, exported and run in its own folder; the
    # groups run side by side (export of one overlaps the builds of another), 4 builds each
    [ "$#" -gt 0 ] || { echo "corpus needs model names, e.g. gpt2,bert vit_b_16"; exit 2; }
    i=0
    end=$((SECONDS + ${CORPUS_BUDGET_S:-540}))  # the whole step, exports included
    for names in "$@"; do
      i=$((i + 1))
      (
        # named by the group, not its place: a later call with other groups must not reuse
        # an earlier call's export (2026-12-07: two groups re-ran the first call's models)
        work=/tmp/amp-corpus-$(printf '%s' "$names" | md5sum | cut -c1-10)
        [ -f "$work/manifest.json" ] || timeout 240 "$PY" -m benchmarks.corpus export "$work" \
          --scale tiny --only "$names" > "$work.export.log" 2>&1
        timeout $((end - SECONDS)) "$PY" -m benchmarks.corpus run "$work" --target cuda --precision fp16,bf16 \
          --jobs "${CORPUS_JOBS:-4}" --timeout 300 --json "$OUT/corpus_cuda_$i.json" \
          > "$OUT/corpus_cuda_$i.log" 2>&1
        tail -3 "$work.export.log" >> "$OUT/corpus_cuda_$i.log"
      ) &
    done
    wait
    # one JSON and one log: the device tool brings back only a few files per call (the fifth
    # group's pair was left out on 2026-12-07)
    "$PY" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
parts = sorted(glob.glob(os.path.join(out, "corpus_cuda_[0-9]*.json")))
rows = [r for p in parts for r in json.load(open(p)).get("rows", [])]
json.dump({"target": "cuda", "rows": rows}, open(os.path.join(out, "corpus_cuda.json"), "w"),
          indent=1)
for p in parts:
    os.remove(p)
PY
    cat "$OUT"/corpus_cuda_[0-9]*.log > "$OUT/corpus_cuda.log" && rm -f "$OUT"/corpus_cuda_[0-9]*.log
    grep -v '^ *$' "$OUT/corpus_cuda.log" | tail -120
    ;;
  *)
    sed -n "2,/^set -uo/{/^set -uo/!p}" "$0"
    exit 2
    ;;
esac
