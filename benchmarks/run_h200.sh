#!/usr/bin/env bash
# Runs on the H200 machine (the device tool), from the repository root:
#   bash benchmarks/run_h200.sh STAGE   (STAGE: one of the cases below; results under $OUT)
# The stages of earlier sessions that ran the old `slidekit bench` (bench-3b, verify-7b, suite-large, spread,
# suite-3b, suite-7b) are in git history with the sessions that ran them; `suite NAME` replaces them.
# Installs the project without the network, plus the carried wheels in .whl/ (kvikio) and .whl-bench/ (Liger,
# torchao, DeepSpeed and what DeepSpeed needs beyond the image: docs/benchmarking.md lists them) when present.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
WHEELS=$(ls .whl/*.whl .whl-bench/*.whl 2>/dev/null)
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    && export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/slidekit-off /tmp/slidekit-bench
build_layer_adam() {  # compile slidekit's fused CPU optimizer kernels once, before the timed runs
  timeout 240 slidekit build > "$OUT/build_layer_adam.log" 2>&1
}
ab_rounds() {  # ab_rounds FILE OPTION "VALUES" "MODEL BATCH"...: per spec, REPEATS (default 1) rounds of one bench
  # process per value of OPTION, in turn, 10 steps after 2 warm-up, the planner's residency; EXTRA: more options
  local file=$1 option=$2 values=$3 spec r v; shift 3
  for spec in "$@"; do
    set -- $spec
    for r in $(seq "${REPEATS:-1}"); do
      for v in $values; do
        # shellcheck disable=SC2086  # EXTRA: one word per option
        timeout 280 python3 -m slidekit.tools.bench --model "$1" --batch "$2" --seq 1024 --resident auto --steps 10 \
          --warmup 2 "$option" "$v" ${EXTRA:-} --out "$file" 2>&1 | tail -1 | cut -c1-300
        echo "$1-b$2 ${option#--} $v round $r: at ${SECONDS}s"
      done
    done
  done
}
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, transformers, platform
print(platform.python_version(), torch.__version__, triton.__version__, transformers.__version__,
      torch.cuda.get_device_name(), torch.cuda.mem_get_info())
PY
# The host (H100 hosts differed by 27-33% in the gate's offload runs, session 35): its CPU and memory.
{ grep -m1 'model name' /proc/cpuinfo; nproc; grep -m1 MemTotal /proc/meminfo; } 2>/dev/null | tr '\n' ' ' | tee -a "$OUT/env.txt"
echo | tee -a "$OUT/env.txt"
case "${1:-tests}" in
  tests)  # the GPU gate: the whole suite plus the residency runs, recorded (benchmarks/gpu_gate.py); where the
    # whole gate does not fit one call, two calls on one tree: --part runs, then --part tests (which completes
    # the record's runs where they are of this tree's slidekit/ and plugins/)
    shift; timeout 585 python3 benchmarks/gpu_gate.py "$@" 2>&1 | tail -40
    ;;
  quick)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/gpu tests/test_tier_placement.py tests/test_reliability.py \
      tests/test_hostmem.py tests/plugins/test_gpu_tier.py tests/test_equivalence.py tests/plugins/test_layer_adam.py 2>&1 \
      | tee "$OUT/tests_quick.log" | tail -15
    B="$OUT/bench.jsonl"
    for spec in "qwen2.5-3b 8 none" "qwen2.5-3b 8 auto" "qwen2.5-3b 32 none" "qwen2.5-7b 16 auto" "qwen2.5-7b 16 none"; do
      set -- $spec
      timeout 150 python3 benchmarks/train_throughput.py --model "$1" --batch "$2" --resident "$3" --steps 4 --out "$B" 2>&1 | tail -1
    done
    ;;
  final)
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_tier_placement.py tests/test_hostmem.py \
      tests/plugins/test_gpu_tier.py tests/test_reliability.py tests/test_equivalence.py 2>&1 | tee "$OUT/tests_final.log" | tail -4
    python3 benchmarks/optimizer_rate.py --numel 233000000 --repeat 3 2>&1 | tee "$OUT/optimizer.json" | tail -1
    timeout 90 python3 benchmarks/tier_bandwidth.py --dir /tmp/slidekit-bench --size-gb 0.5 > "$OUT/tiers.jsonl" 2> "$OUT/tiers.txt"; tail -12 "$OUT/tiers.txt"
    B="$OUT/bench.jsonl"
    for tier in ram posix; do
      timeout 100 python3 benchmarks/train_throughput.py --model qwen2.5-1.5b --batch 8 --resident none --state-tier $tier \
        --offload-dir /tmp/slidekit-off --steps 1 --warmup 1 --out "$B" 2>&1 | tail -1
    done
    timeout 150 python3 benchmarks/kernels.py > "$OUT/kernels.jsonl" 2> "$OUT/kernels.txt"; tail -25 "$OUT/kernels.txt"
    ;;
  verify)  # GPU tests (faults, soak, planner estimates), the end-to-end job, the kernel sweep
    export SLIDEKIT_PLANNER_LOG="$OUT/planner.jsonl"
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_reliability.py tests/test_failures.py \
      tests/test_hostmem.py tests/plugins/test_gpu_tier.py tests/test_planner.py 2>&1 | tee "$OUT/tests_verify.log" | tail -12
    timeout 240 python3 benchmarks/e2e_finetune.py --preset qwen2.5-1.5b --work /tmp/e2e --steps 10 --kill-after 5 \
      --out "$OUT/e2e.json" 2>&1 | tail -2
    cp /tmp/e2e/b/report.png "$OUT/e2e_report.png" 2>/dev/null; rm -rf /tmp/e2e
    timeout 150 python3 benchmarks/kernels.py --tune > "$OUT/tune.jsonl" 2>&1; tail -8 "$OUT/tune.jsonl"
    ;;
  big)  # the largest model: Mistral-Small-24B shape, adamw_8bit state on NVMe; host RSS with state on posix
    B="$OUT/big.jsonl"
    python3 benchmarks/optimizer_rate.py --numel 233000000 --repeat 3 2>&1 | tee "$OUT/optimizer.json" | tail -1
    for tier in ram posix; do
      timeout 100 python3 benchmarks/train_throughput.py --model qwen2.5-1.5b --batch 8 --resident none --state-tier $tier \
        --offload-dir /tmp/slidekit-off --steps 1 --warmup 1 --out "$B" 2>&1 | tail -1
    done
    df -h /tmp | tail -1; free -g | head -2
    python3 -c "from pathlib import Path; from slidekit.tools.bench import write_config; write_config('mistral-small-24b', Path('/tmp/m24'), 1024)"
    python3 -m slidekit.cli plan --model /tmp/m24 --random-init --optimizer adamw_8bit --state-tier posix \
      --offload-dir /tmp/slidekit-off --batch-size 8 --seq-len 1024 2>&1 | tee "$OUT/plan_24b.txt" | tail -4
    timeout 330 python3 benchmarks/train_throughput.py --model mistral-small-24b --batch 8 --optimizer adamw_8bit \
      --state-tier posix --offload-dir /tmp/slidekit-off --steps 2 --warmup 1 --out "$B" 2>&1 | tail -3
    ;;
  bench)
    B="$OUT/bench.jsonl"
    for spec in "qwen2.5-3b 8 none" "qwen2.5-3b 8 auto" "qwen2.5-3b 32 none" "qwen2.5-7b 16 none" "qwen2.5-7b 16 auto"; do
      set -- $spec
      timeout 200 python3 benchmarks/train_throughput.py --model "$1" --batch "$2" --resident "$3" --steps 4 --out "$B" 2>&1 | tail -1
    done
    ;;
  micro)
    python3 benchmarks/optimizer_rate.py --numel 233000000 --repeat 3 2>&1 | tee "$OUT/optimizer.json" | tail -2
    timeout 200 python3 benchmarks/tier_bandwidth.py --dir /tmp/slidekit-bench --size-gb 0.5 > "$OUT/tiers.jsonl" 2> "$OUT/tiers.txt"; tail -20 "$OUT/tiers.txt"
    timeout 200 python3 benchmarks/kernels.py > "$OUT/kernels.jsonl" 2> "$OUT/kernels.txt"; tail -30 "$OUT/kernels.txt"
    ;;
  tiers-kernels)  # issues 3 and 5 on the GPU: every tier (gds through kvikio), the compiled Triton kernels
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/plugins/test_gds_tier.py tests/plugins/test_posix_tier.py \
      tests/plugins/test_ram_tier.py tests/plugins/test_gpu_tier.py tests/test_tier_placement.py \
      tests/plugins/test_triton_kernels.py tests/plugins/test_triton_compile.py tests/plugins/test_kernel_conformance.py \
      tests/plugins/test_torch_ref.py 2>&1 | tee "$OUT/tests_tiers_kernels.log" | tail -25
    python3 -m slidekit.cli plugins 2>&1 | tee "$OUT/plugins.txt" | grep -i -E "gds|triton" | head -6
    python3 benchmarks/host_bandwidth.py --gib 1 --repeat 5 | tee "$OUT/host_bandwidth.json"
    ;;
  largest)  # issue 17's runs, one argument each, in order: "MODEL BATCH [EXTRA...]", MODEL a preset or
    # BASE@LAYERSL (a published shape cut to another depth: benchmarks/largest_model.py), EXTRA more bench
    # options (they are `slidekit plan`'s too). Per run: the planner's view of this machine and the run's
    # stderr (log-TAG.txt), its record (run-TAG.jsonl), its trace (trace-TAG.json.gz); at most 2 runs.
    # NPROC=N (the 2-GPU machine, issue 19): N data-parallel ranks under torchrun, NVLink multicast off, the
    # plan of rank 0, a trace per rank; --batch is per GPU.
    shift; DEADLINE=${DEADLINE:-550}  # WARMUP: untimed steps first (default 2); keep DEADLINE well under the call's 600 s
    NPROC=${NPROC:-1}; LAUNCH=(python3); RANKS=()
    if [ "$NPROC" -gt 1 ]; then
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      LAUNCH=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC"); RANKS=(--nproc-per-node "$NPROC")
    fi
    timeout 200 slidekit build adamw_8bit > "$OUT/build.log" 2>&1; echo "build rc $? at ${SECONDS}s"
    for spec in "$@"; do
      set -- $spec; MODEL=$1; BATCH=$2; shift 2
      TAG=$(echo "$MODEL-b$BATCH" | tr '@' '-'); CFG=/tmp/cfg-$TAG; LOG="$OUT/log-$TAG.txt"; mkdir -p /var/tmp/sk-off
      if [[ $MODEL == *@*L ]]; then  # a cut shape: plan its written config.json
        L=${MODEL#*@}; CUT=(benchmarks/largest_model.py --base "${MODEL%@*}" --layers "${L%L}")
        python3 "${CUT[@]}" --write-config "$CFG" > /dev/null; RUN=("${LAUNCH[@]}" "${CUT[@]}" --)
        SHAPE=(--model "$CFG" --random-init)
      else
        RUN=("${LAUNCH[@]}" -m slidekit.tools.bench --model "$MODEL"); SHAPE=(--preset "$MODEL")
      fi
      { echo "commit ${COMMIT:-unknown}; $(free -g | sed -n 2p); $(df -h /var/tmp | tail -1)"
        python3 -m slidekit.cli plan "${SHAPE[@]}" --optimizer adamw_8bit --resident-weights auto "${RANKS[@]}" \
          --batch-size "$BATCH" --seq-len 1024 --offload-dir /var/tmp/sk-off "$@"; } > "$LOG" 2>&1
      grep -E "predicted step|verdict" "$LOG" | head -3
      LEFT=$((DEADLINE - SECONDS)); [ "$LEFT" -lt 60 ] && { echo "$TAG: not run, ${LEFT}s left"; continue; }
      timeout "$LEFT" "${RUN[@]}" --batch "$BATCH" --seq 1024 --optimizer adamw_8bit --resident auto \
        --resident-weights auto --offload-dir /var/tmp/sk-off --steps 20 --warmup "${WARMUP:-2}" --repeat-batch --lr 1e-4 \
        --trace "/tmp/trace-$TAG.json" "$@" > "$OUT/run-$TAG.jsonl" 2>> "$LOG"; echo "$TAG: rc $? at ${SECONDS}s"
      for t in /tmp/trace-"$TAG".json /tmp/trace-"$TAG".rank*.json; do
        [ -f "$t" ] && gzip -c "$t" > "$OUT/$(basename "$t").gz"
      done
      cut -c1-700 "$OUT/run-$TAG.jsonl"; tail -3 "$LOG" | cut -c1-300; rm -rf /var/tmp/sk-off
    done
    ;;
  ratio)  # issue 16 item 3: forced offload against all-resident, same call: bash benchmarks/run_h200.sh ratio "MODEL BATCHES"...
    # (BATCHES comma-separated); per model: all-resident, then forced offload with a trace per batch; 10 steps after 2 warm-up
    shift; build_layer_adam; B="$OUT/ratio.jsonl"
    for spec in "$@"; do
      set -- $spec
      timeout 200 python3 -m slidekit.tools.bench --model "$1" --batch "$2" --seq 1024 --resident all --steps 10 --warmup 2 \
        --out "$B" 2>&1 | tail -1 | cut -c1-300; echo "$1 all: at ${SECONDS}s"
      for b in ${2//,/ }; do
        timeout 200 python3 -m slidekit.tools.bench --model "$1" --batch "$b" --seq 1024 --resident none --steps 10 --warmup 2 \
          --trace "/tmp/trace-$1-b$b.json" --out "$B" 2>&1 | tail -1 | cut -c1-300; echo "$1 none b$b: at ${SECONDS}s"
        mkdir -p /tmp/sk-traces; gzip -c "/tmp/trace-$1-b$b.json" > "/tmp/sk-traces/trace-offload-$1-b$b.json.gz" 2>/dev/null
      done
    done
    tar -cf "$OUT/traces-ratio.tar" -C /tmp/sk-traces .  # one file: a call brings back at most 8
    ;;
  clip)  # issue 16 item 1, forced offload: bash benchmarks/run_h200.sh clip "MODEL BATCH"...; per spec, in one call: no clipping,
    # a clip that never fires (1e6) speculated, max_grad_norm 1.0 deferred and speculated; 10 steps after 2 warm-up.
    # CLIPS="none|1e6 speculate|..." picks the runs ('|' between them; "none" is the unclipped run).
    shift; build_layer_adam; B="$OUT/clip.jsonl"
    IFS='|' read -ra CLIP_RUNS <<< "${CLIPS:-none|1e6 speculate|1.0 defer|1.0 speculate}"
    for spec in "$@"; do
      set -- $spec
      for c in "${CLIP_RUNS[@]}"; do
        set -- "$1" "$2" $c; CLIP=(); [ "$3" != none ] && CLIP=(--clip "$3" --clip-overlap "$4")
        TAG="$1-b$2-clip-$3${4:+-$4}"
        timeout 200 python3 -m slidekit.tools.bench --model "$1" --batch "$2" --seq 1024 --resident none --steps 10 --warmup 2 \
          "${CLIP[@]}" --trace "/tmp/trace-$TAG.json" --out "$B" 2>&1 | tail -1 | cut -c1-300; echo "$TAG: at ${SECONDS}s"
        mkdir -p /tmp/sk-clip; gzip -c "/tmp/trace-$TAG.json" > "/tmp/sk-clip/trace-$TAG.json.gz" 2>/dev/null
      done
    done
    tar -cf "$OUT/traces-clip.tar" -C /tmp/sk-clip .  # one file: a call brings back at most 8
    ;;
  order)  # engine.update_order, forced offload (NOTES 32): bash benchmarks/run_h200.sh order "MODEL BATCHES"...
    # (BATCHES comma-separated); per model and batch, REPEATS (default 2) rounds of: arrival, then forward, one
    # process each, 10 steps after 2 warm-up; a trace per run (the last round's kept)
    shift; build_layer_adam; B="$OUT/order.jsonl"
    for spec in "$@"; do
      set -- $spec
      for b in ${2//,/ }; do
        for r in $(seq "${REPEATS:-2}"); do
          for o in arrival forward; do
            TAG="$1-b$b-$o"
            timeout 200 python3 -m slidekit.tools.bench --model "$1" --batch "$b" --seq 1024 --resident none --steps 10 \
              --warmup 2 --update-order "$o" --trace "/tmp/trace-$TAG.json" --out "$B" 2>&1 | tail -1 | cut -c1-300
            echo "$TAG round $r: at ${SECONDS}s"
            mkdir -p /tmp/sk-order; gzip -c "/tmp/trace-$TAG.json" > "/tmp/sk-order/trace-$TAG.json.gz" 2>/dev/null
          done
        done
      done
    done
    tar -cf "$OUT/traces-order.tar" -C /tmp/sk-order .  # one file: a call brings back at most 8
    ;;
  residency)  # NOTES 38, "auto" residency trading units for kept activations: bash benchmarks/run_h200.sh residency
    # "MODEL BATCHES"... (BATCHES comma-separated); per model and batch, REPEATS (default 2) rounds of resident all, auto,
    # none, one process each, 10 whole steps after 2 warm-up (the record's resident_units and kept_layers say what auto kept)
    shift; build_layer_adam; B="$OUT/residency.jsonl"
    for spec in "$@"; do
      set -- $spec
      for b in ${2//,/ }; do
        for r in $(seq "${REPEATS:-2}"); do
          for res in all auto none; do
            timeout 240 python3 -m slidekit.tools.bench --model "$1" --batch "$b" --seq 1024 --resident "$res" --steps 10 \
              --warmup 2 --out "$B" 2>&1 | tail -1 | cut -c1-300
            echo "$1-b$b-$res round $r: at ${SECONDS}s"
          done
        done
      done
    done
    ;;
  roof)  # issue 16 item 2 (NOTES 41): the optimizer kernels against their passes' memory streams without arithmetic,
    # 233M unit, 16 threads, the same rounds; with the host's CPU (lscpu) and memory (free) beside them; BASE=DIR adds
    # the kernels built from another commit's csrc copy in the same rounds (fp8_codec.py's --base: an A/B on one host)
    shift; (lscpu; free -g) > "$OUT/host.txt" 2>&1
    # every kernel the rate loads (this tree's, the streams probe, BASE's) built side by side, one process each
    build_layer_adam & timeout 300 python3 benchmarks/fp8_codec.py build --timeout 280 --streams ${BASE:+--base "$BASE"} \
      > "$OUT/build_kernels.json" 2>&1; wait; echo "built: at ${SECONDS}s"; cut -c1-600 "$OUT/build_kernels.json"
    timeout 420 python3 benchmarks/fp8_codec.py rate --numel "${NUMEL:-233000000}" --repeat "${ROUNDS:-5}" --threads "${THREADS:-16}" \
      --streams ${BASE:+--base "$BASE"} > "$OUT/roof.json" 2>&1; tail -c 3000 "$OUT/roof.json"; echo; echo "roof: at ${SECONDS}s"
    ;;
  setup35)  # NOTES 34-35, forced offload at 3B batch 8 (after the gate of the commit that has them): where the setup
    # goes, what update order "auto" takes (the record's forward_updates), and BF16 upload copies in the forward order;
    # 10 whole steps after 2 warm-up, one process each
    shift; build_layer_adam; B="$OUT/setup35.jsonl"
    timeout 120 python3 benchmarks/setup_profile.py --model qwen2.5-3b --batch 8 --resident none --top 40 \
      > "$OUT/setup_profile.txt" 2>&1; echo "setup profile: at ${SECONDS}s"
    for extra in "--update-order auto" "--update-order forward --upload-copy on" "--update-order forward --upload-copy off"; do
      # shellcheck disable=SC2086  # one word per option
      timeout 200 python3 -m slidekit.tools.bench --model qwen2.5-3b --batch 8 --seq 1024 --resident none --steps 10 \
        --warmup 2 $extra --out "$B" 2>&1 | tail -1 | cut -c1-300
      echo "$extra: at ${SECONDS}s"
    done
    ;;
  weights)  # the recommendation's sliding resident weights against keeping them (NOTES 33):
    # bash benchmarks/run_h200.sh weights "MODEL BATCH"...; per spec, REPEATS (default 1) rounds of: the planner's
    # residency with --resident-weights keep, then auto, one process each, 10 steps after 2 warm-up, the host
    # updates in arrival order (as the planner's calibration); EXTRA="..." more bench options for every run
    shift; build_layer_adam; EXTRA="--update-order arrival ${EXTRA:-}" ab_rounds "$OUT/weights.jsonl" --resident-weights "keep auto" "$@"
    ;;
  window)  # the window's depth (NOTES 58): bash benchmarks/run_h200.sh window "MODEL BATCH"... with WINDOWS (default
    # "4 3") taking turns, REPEATS (default 1) rounds, one process each, 10 steps after 2 warm-up, the planner's
    # placement and update order unless EXTRA="..." names more bench options (e.g. --optimizer adamw_8bit)
    shift; build_layer_adam; ab_rounds "$OUT/window.jsonl" --window "${WINDOWS:-4 3}" "$@"
    ;;
  suite)  # one suite of `slidekit bench` (issue 15): bash benchmarks/run_h200.sh suite NAME COMMIT [BENCH OPTIONS]
    # NAME: a preset of slidekit.tools.bench.suite_presets.SUITES; it builds its kernels itself, then runs what
    # its time plan keeps within what is left of the call (BUDGET, default 575 s, less the install; docs/benchmarking.md
    # has the bare command). Where the tree carries an earlier call's records as cont/suite-NAME.jsonl (untracked),
    # the suite continues them (--continue; add --other-host for another machine). The runs' logs (LOGS, default
    # /tmp/blogs): $OUT/logs.tgz.
    shift; NAME=${1:?suite name}; COMMIT=${2:-unknown}; shift $(($# < 2 ? $# : 2))
    LOGS=${LOGS:-/tmp/blogs}; rm -rf "$LOGS"; CONT=(); [ -f "cont/suite-$NAME.jsonl" ] && CONT=(--continue "cont/suite-$NAME.jsonl")
    LEFT=$((${BUDGET:-575} - SECONDS)); echo "suite $NAME at $COMMIT${CONT[*]:+, continuing ${CONT[1]}}: budget $LEFT s"
    python3 -m slidekit.cli bench --suite "$NAME" --commit "$COMMIT" --time-budget "$LEFT" \
      --out "$OUT" --logs "$LOGS" ${CONT[@]+"${CONT[@]}"} "$@" 2>&1 | tail -80
    tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
    ;;
esac
