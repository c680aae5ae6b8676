#!/usr/bin/env bash
# Runs on the H200 machine (the device tool), from the repository root:
#   bash benchmarks/run_h200.sh STAGE   (STAGE: one of the cases below; results under $OUT)
# Installs the project without the network, plus carried wheels in .whl/ (kvikio, Liger, torchao, DeepSpeed and
# what DeepSpeed needs beyond the image: hjson, pydantic) when present.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/slidekit-off /tmp/slidekit-bench
build_layer_adam() {  # compile slidekit's fused CPU optimizer kernels once, before the timed runs
  timeout 240 slidekit build > "$OUT/build_layer_adam.log" 2>&1
}
RUN="--seq 1024 --warmup 2 --steps 3 --activations device"  # the settings of every suite run
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, transformers, platform
print(platform.python_version(), torch.__version__, triton.__version__, transformers.__version__,
      torch.cuda.get_device_name(), torch.cuda.mem_get_info())
PY
case "${1:-tests}" in
  tests)  # the GPU gate: the whole suite plus the residency runs, recorded (benchmarks/gpu_gate.py)
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
  bench-3b)
    # slidekit (forced full offload, then auto residency) vs no offload, torchao and DeepSpeed ZeRO-Offload:
    # same model, batches and tokens, every run its own process, all inside 570 s of this script. The two
    # CPU Adam extensions (slidekit's layer_adam, DeepSpeed's cpu_adam) are built first, side by side.
    export DS_ACCELERATOR=cuda DS_SKIP_CUDA_CHECK=1
    build_layer_adam &
    timeout 120 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
      > "$OUT/build_ds_cpu_adam.log" 2>&1 &
    wait
    echo "extensions built at ${SECONDS} s:"; tail -n 2 "$OUT"/build_*.log
    python3 -m slidekit.cli bench --model qwen2.5-3b --batch 8,16,32 --seq 1024 --warmup 2 --steps 3 \
      --resident none,auto --baselines none,torchao,deepspeed --timeout 120 --time-budget $((560 - SECONDS)) \
      --out "$OUT/bench_3b.jsonl" --markdown "$OUT/bench_3b.md" --logs "$OUT/bench_3b_logs" 2>&1 | tail -40
    ;;
  tiers-kernels)  # issues 3 and 5 on the GPU: every tier (gds through kvikio), the compiled Triton kernels
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/plugins/test_gds_tier.py tests/plugins/test_posix_tier.py \
      tests/plugins/test_ram_tier.py tests/plugins/test_gpu_tier.py tests/test_tier_placement.py \
      tests/plugins/test_triton_kernels.py tests/plugins/test_triton_compile.py tests/plugins/test_kernel_conformance.py \
      tests/plugins/test_torch_ref.py 2>&1 | tee "$OUT/tests_tiers_kernels.log" | tail -25
    python3 -m slidekit.cli plugins 2>&1 | tee "$OUT/plugins.txt" | grep -i -E "gds|triton" | head -6
    python3 benchmarks/host_bandwidth.py --gib 1 --repeat 5 | tee "$OUT/host_bandwidth.json"
    ;;
  verify-7b)  # the third session's unmeasured changes: gradient pieces (host RSS per parameter at 7B and 3B), the
    # device-timed gradient copy (eta), adamw_8bit's host RSS with its state in RAM, a trace of partial residency
    build_layer_adam
    python3 -m slidekit.cli bench --model qwen2.5-7b --batch 16 $RUN --resident none,0.65 --baselines "" --timeout 150 \
      --out "$OUT/verify.jsonl" --markdown "$OUT/verify_7b_layer_adam.md" 2>&1 | tail -5
    python3 -m slidekit.cli bench --model qwen2.5-7b --batch 16 $RUN --resident none --optimizer adamw_8bit --baselines "" \
      --timeout 150 --out "$OUT/verify.jsonl" --markdown "$OUT/verify_7b_adamw_8bit.md" 2>&1 | tail -4
    python3 -m slidekit.cli bench --model qwen2.5-3b --batch 8 $RUN --resident none --baselines "" --timeout 100 \
      --out "$OUT/verify.jsonl" --markdown "$OUT/verify_3b.md" 2>&1 | tail -4
    timeout 150 python3 benchmarks/train_throughput.py --model qwen2.5-7b --batch 16 $RUN --resident 0.65 --steps 2 \
      --trace "$OUT/trace_7b_b16_r065.json" 2>&1 | tail -1
    ;;
  suite-large)  # Llama-3.1-8B and Qwen2.5-14B in one call: torchao and DeepSpeed need more host RAM than the machine has
    # (the bench's guard says so), no offload fits neither at batch 16; Qwen2.5-14B's layer_adam state (~180 GB)
    # fits in RAM only with part of the units on the GPU, so it runs with the planner's choice alone.
    build_layer_adam
    python3 -m slidekit.cli bench --model llama-3.1-8b --batch 8,16 $RUN --resident none,auto \
      --baselines none,torchao,deepspeed --timeout 150 --time-budget 300 --out "$OUT/bench_llama-3.1-8b.jsonl" \
      --markdown "$OUT/bench_llama-3.1-8b.md" 2>&1 | tail -12
    python3 -m slidekit.cli bench --model qwen2.5-14b --batch 8,16 $RUN --resident auto --baselines "" --timeout 150 \
      --time-budget $((560 - SECONDS)) --out "$OUT/bench_qwen2.5-14b.jsonl" --markdown "$OUT/bench_qwen2.5-14b.md" \
      2>&1 | tail -5
    ;;
  spread)  # host units spread over the backward order, prefetches that never wait: 7B at batch 16 with 0.65 of the
    # units resident and with none, Qwen2.5-14B with the planner's choice (compare with the verify-7b and suite-large
    # calls of the same day), then a trace of the 7B 0.65 run
    build_layer_adam
    python3 -m slidekit.cli bench --model qwen2.5-7b --batch 16 $RUN --resident 0.65,none --baselines "" --timeout 140 \
      --out "$OUT/spread.jsonl" --markdown "$OUT/spread_7b.md" 2>&1 | tail -4
    python3 -m slidekit.cli bench --model qwen2.5-14b --batch 16,8 $RUN --resident auto --baselines "" --timeout 140 \
      --time-budget $((380 - SECONDS)) --out "$OUT/spread.jsonl" --markdown "$OUT/spread_14b.md" 2>&1 | tail -4
    if [ $SECONDS -lt 330 ]; then
      timeout $((420 - SECONDS)) python3 benchmarks/train_throughput.py --model qwen2.5-7b --batch 16 $RUN --resident 0.65 \
        --steps 2 --trace "$OUT/trace_7b_b16_r065.json" 2>&1 | tail -1
    fi
    ;;
  suite|suite-3b|suite-7b)
    # One model size per call: slidekit (forced full offload, part of the units resident, the planner's choice)
    # against no offload, torchao and DeepSpeed ZeRO-Offload on the same model, batches and tokens.
    #   bash benchmarks/run_h200.sh suite MODEL BATCHES RESIDENT     e.g. suite qwen2.5-14b 8,16 none,auto
    # suite-3b first runs the GPU tests of the third session's changes (fused device update, backward window,
    # placement still bitwise with resident units); SKIP_TESTS=1 skips them.
    export DS_ACCELERATOR=cuda DS_SKIP_CUDA_CHECK=1
    case "$1" in
      suite-3b) M=qwen2.5-3b; BATCHES=8,16,32; RESIDENT=none,auto ;;
      suite-7b) M=qwen2.5-7b; BATCHES=8,16; RESIDENT=none,0.65,auto ;;
      *) M=${2:?model preset}; BATCHES=${3:-8,16,32}; RESIDENT=${4:-none,auto} ;;
    esac
    timeout 120 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
      > "$OUT/build_ds_cpu_adam.log" 2>&1 &
    build_layer_adam
    if [ "$1" = suite-3b ] && [ -z "${SKIP_TESTS:-}" ]; then
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/plugins/test_adam_triton.py \
        tests/plugins/test_layer_adam.py tests/test_telemetry.py tests/test_tier_placement.py 2>&1 \
        | tee "$OUT/tests_suite.log" | tail -6
    fi
    wait
    echo "ready at ${SECONDS} s"; free -g | head -2
    python3 -m slidekit.cli bench --model $M --batch $BATCHES $RUN \
      --resident $RESIDENT --baselines none,torchao,deepspeed --timeout 150 --time-budget $((575 - SECONDS)) \
      --out "$OUT/bench_$M.jsonl" --markdown "$OUT/bench_$M.md" --logs "$OUT/bench_logs" 2>&1 | tail -30
    ;;
esac
