#!/usr/bin/env bash
# Runs on the H200 machine (the device tool), from the repository root:
#   bash benchmarks/run_h200.sh tests|bench   (results under $OUT)
# Installs the project without the network, plus carried wheels in .whl/ (kvikio, Liger) when present.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/slidekit-off /tmp/slidekit-bench
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, transformers, platform
print(platform.python_version(), torch.__version__, triton.__version__, transformers.__version__,
      torch.cuda.get_device_name(), torch.cuda.mem_get_info())
PY
case "${1:-tests}" in
  tests)
    timeout 520 python3 -m pytest -q -p no:cacheprovider -rs --durations=15 tests 2>&1 | tee "$OUT/tests.log" | tail -40
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
esac
