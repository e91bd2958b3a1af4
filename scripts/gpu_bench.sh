#!/usr/bin/env bash
# On one GPU: the branched step and a training step's model-FLOPs utilization at the bucket widths
# of the straggler benchmark's model (and of gpt_tiny's GPU size), as JSON + markdown under
# results/gpu/ (or $1). Needs JAX with CUDA in ./.venv (pip install -U "jax[cuda12]"); the test
# suite and the other benchmarks never need a GPU.
#
#   scripts/gpu_bench.sh [OUT_DIR]
#   SEMIJAX_BENCH_PLATFORM=cpu SEMIJAX_BENCH_TINY=1 scripts/gpu_bench.sh /tmp/smoke  # CPU smoke
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
OUT="${1:-results/gpu}"
PLATFORM="${SEMIJAX_BENCH_PLATFORM:-cuda}"
export JAX_PLATFORMS="$PLATFORM"
BACKEND="$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null || true)"
if [[ "$PLATFORM" != cpu && "$BACKEND" != gpu ]]; then
  echo "gpu_bench: no GPU backend in $VENV (JAX_PLATFORMS=$PLATFORM gave '${BACKEND:-an error}');" \
       "install JAX with CUDA there: $PY -m pip install -U 'jax[cuda12]'" >&2
  exit 2
fi
mkdir -p "$OUT"
if [[ -n "${SEMIJAX_BENCH_TINY:-}" ]]; then      # a smoke run of every step, in seconds
  "$PY" experiments/bench_widths.py --d_model=64 --heads=4 --d_ff=128 --seq_len=16 --batch=2 \
      --num_widths=3 --repeats=2 --out_dir="$OUT/bench_widths_tiny"
  "$PY" experiments/bench_mfu.py --model=tiny --num_widths=3 --steps=2 --out_dir="$OUT/mfu_tiny"
  exit 0
fi
# The straggler benchmark's model (d_model 256, d_ff 1024, 16 heads, 64 tokens x 16) at 6 widths.
"$PY" experiments/bench_widths.py --d_model=256 --heads=16 --d_ff=1024 --seq_len=64 --batch=16 \
    --num_widths=6 --repeats=50 --out_dir="$OUT/bench_widths_bench_model"
"$PY" experiments/bench_mfu.py --model=bench --num_widths=6 --steps=50 \
    --out_dir="$OUT/mfu_bench_model"
# gpt_tiny's GPU size (d_model 512, d_ff 2048, 6 layers, 256 tokens x 64): big enough to load a GPU.
"$PY" experiments/bench_widths.py --d_model=512 --heads=16 --d_ff=2048 --seq_len=256 --batch=64 \
    --num_widths=6 --repeats=50 --out_dir="$OUT/bench_widths_gpt_tiny"
"$PY" experiments/bench_mfu.py --model=gpt_tiny --num_widths=6 --steps=50 \
    --out_dir="$OUT/mfu_gpt_tiny"
echo "gpu_bench: wrote $OUT/*/bench_widths.{json,md} and $OUT/*/bench_mfu.{json,md}"
