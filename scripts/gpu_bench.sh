#!/usr/bin/env bash
# On one GPU: semijax's training step against the same GPT written plainly in JAX (GPT-2 small,
# float32 and bfloat16, bench_peer.py), the branched step with each width kernel, switch and
# pallas (bench_widths.py), a step's model-FLOPs utilization at the bucket widths (bench_mfu.py)
# and a few train.py steps of semi sampling speeds with the probe, its cost per sample and the
# MFU the metrics show (bench_probe.py), as JSON + markdown under results/gpu/ (or $1), each
# part with a timeout; a short table of the parts last.
#
# Parts run in order of what they decide: the peer benchmark (bfloat16 against plain JAX), the
# width kernel's target block, the whole step's MFU, the probe, then the smaller shapes. With
# SEMIJAX_BENCH_BUDGET=SECONDS the whole run ends within that time: a part gets at most what is
# left (less a margin for the summary) and is skipped when under a minute is left. Every
# benchmark rewrites its JSON + markdown after each of its interleaved rounds, so a part that
# runs out of time keeps the rounds it finished (the summary says how many).
#
# Python: the `python3` on PATH when it already has JAX with the wanted backend and semijax's
# packages (what a GPU machine without network access has; wheels in ./.whl/ of packages it lacks
# are installed into $SEMIJAX_BENCH_SITE, default /tmp/semijax-site, with pip --no-index), else
# ./.venv, built by scripts/_venv.sh (needs PyPI; add JAX with CUDA to it yourself:
# .venv/bin/python -m pip install -U "jax[cuda12]"). The test suite never needs a GPU.
#
#   scripts/gpu_bench.sh [OUT_DIR]
#   SEMIJAX_BENCH_BUDGET=540 scripts/gpu_bench.sh results/gpu  # what fits in 9 minutes
#   SEMIJAX_BENCH_PLATFORM=cpu SEMIJAX_BENCH_TINY=1 scripts/gpu_bench.sh /tmp/smoke  # CPU smoke
#   SEMIJAX_BENCH_PARTS="peer" SEMIJAX_BENCH_TIMEOUT=300 scripts/gpu_bench.sh        # one part
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-results/gpu}"
PLATFORM="${SEMIJAX_BENCH_PLATFORM:-cuda}"
PARTS="${SEMIJAX_BENCH_PARTS:-peer widths mfu probe}"
SITE="${SEMIJAX_BENCH_SITE:-/tmp/semijax-site}"
BUDGET="${SEMIJAX_BENCH_BUDGET:-0}"   # seconds for the whole run; 0: each part's own limit
MARGIN=20                             # seconds kept for the summary
MIN_PART=60                           # a part is not started with less than this left
export JAX_PLATFORMS="$PLATFORM"
WANT="gpu"
[[ "$PLATFORM" == cpu ]] && WANT="cpu"
cd "$ROOT"

backend_of() {    # the JAX backend python $1 gets, or nothing
  "$1" -c 'import jax; print(jax.default_backend())' 2>/dev/null || true
}
has_packages() {  # python $1 imports what semijax needs
  "$1" -c 'import jax, flax, optax, orbax.checkpoint, absl, ml_collections, tensorboardX, scipy' \
      >/dev/null 2>&1
}

PY="$(command -v python3 || true)"
if [[ -n "$PY" && "$(backend_of "$PY")" == "$WANT" ]] && ! has_packages "$PY"; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if ! has_packages "$PY" && compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_bench: installing .whl/*.whl into $SITE for $PY" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade \
        --target "$SITE" .whl/*.whl
  fi
fi
if [[ -n "$PY" && "$(backend_of "$PY")" == "$WANT" ]] && has_packages "$PY"; then
  echo "gpu_bench: using $PY (JAX backend $WANT), no virtualenv" >&2
else
  source "$ROOT/scripts/_venv.sh"        # sets PY to ./.venv/bin/python
  BACKEND="$(backend_of "$PY")"
  if [[ "$BACKEND" != "$WANT" ]]; then
    echo "gpu_bench: no $WANT backend in python3 or $VENV (JAX_PLATFORMS=$PLATFORM gave" \
         "'${BACKEND:-an error}'); install JAX with CUDA: $PY -m pip install -U 'jax[cuda12]'" >&2
    exit 2
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

STATUS=()
FAILED=0
rounds_of() {     # rounds_of DIR: "N rounds" of the JSON a benchmark wrote under DIR, or nothing
  "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.json")):
  n = json.load(open(path)).get("rounds_done")
  if n is not None:
    print(f"{n} round{'s' * (n != 1)} written")
    break
PYEOF
}
part() {          # part NAME SECONDS SCRIPT FLAGS...: runs one benchmark into $OUT/NAME
  local name=$1 limit=${SEMIJAX_BENCH_TIMEOUT:-$2} script=$3 start=$SECONDS rc=0
  shift 3
  if (( BUDGET > 0 )); then
    local left=$(( BUDGET - SECONDS - MARGIN ))
    if (( left < MIN_PART )); then
      echo "gpu_bench: $name skipped, ${left}s of the ${BUDGET}s budget left" >&2
      STATUS+=("| $name | skipped (budget) | 0 | – |")
      return
    fi
    (( limit > left )) && limit=$left
  fi
  echo "gpu_bench: $name (at most ${limit}s)" >&2
  timeout "$limit" "$PY" "$script" "$@" --out_dir="$OUT/$name" 2>&1 | tee "$OUT/$name.log" \
      || rc=${PIPESTATUS[0]}
  local what="ok"
  if [[ $rc == 124 ]]; then what="timed out"; elif [[ $rc != 0 ]]; then what="exit $rc"; fi
  if [[ $rc != 0 ]]; then
    FAILED=1
    local done_rounds
    done_rounds="$(rounds_of "$OUT/$name")"
    [[ -n "$done_rounds" ]] && what="$what, $done_rounds"
  fi
  STATUS+=("| $name | $what | $((SECONDS - start)) | $OUT/$name/ |")
}
wants() { [[ " $PARTS " == *" $1 "* ]]; }

if [[ -n "${SEMIJAX_BENCH_TINY:-}" ]]; then      # a smoke run of every part, in seconds
  wants peer && part peer_tiny 300 experiments/bench_peer.py --d_model=32 --d_ff=64 --heads=4 \
      --layers=1 --seq_len=16 --batch=2 --steps=2 --rounds=2
  wants widths && part widths_tiny 300 experiments/bench_widths.py --d_model=64 --heads=4 \
      --d_ff=128 --seq_len=16 --batch=2 --num_widths=3 --repeats=2 --rounds=2
  wants mfu && part mfu_tiny 300 experiments/bench_mfu.py --model=tiny --num_widths=3 --steps=2 \
      --rounds=2
  wants probe && part probe_tiny 300 experiments/bench_probe.py --model=tiny --steps=12
else
  # GPT-2 small (byte vocabulary) on one device: plain JAX, semijax even, semijax branched.
  wants peer && part peer_gpt2_small 480 experiments/bench_peer.py --d_model=768 --d_ff=3072 \
      --heads=12 --layers=12 --seq_len=1024 --batch=8 --tensor=1 --precision=bfloat16,float32 \
      --attention=auto --steps=10 --rounds=5
  # The width kernel's target block (d_model 1024, d_ff 4096, 16 heads, 1024 tokens x 8): the
  # branched step at most 1.03x the single-width one, a quarter of the units at most 0.35 of
  # the full width's time.
  wants widths && part widths_block_1024 300 experiments/bench_widths.py --d_model=1024 \
      --heads=16 --d_ff=4096 --seq_len=1024 --batch=8 --num_widths=4 --repeats=10 --rounds=5 \
      --modes=saved
  # gpt_tiny's GPU size (d_model 512, d_ff 2048, 6 layers, 256 tokens x 64, bfloat16): the whole
  # step at 6 widths, and through train.py with semi sampling with the probe every 4 steps.
  wants mfu && part mfu_gpt_tiny 300 experiments/bench_mfu.py --model=gpt_tiny --num_widths=6 \
      --steps=10 --rounds=5
  wants probe && part probe_gpt_tiny 300 experiments/bench_probe.py --model=gpt_tiny --steps=60
  # The straggler benchmark's model (d_model 256, d_ff 1024, 16 heads, 64 tokens x 16), and one
  # block of gpt_tiny's GPU size, at 6 widths.
  wants widths && part widths_bench_model 300 experiments/bench_widths.py --d_model=256 \
      --heads=16 --d_ff=1024 --seq_len=64 --batch=16 --num_widths=6 --repeats=10 --rounds=5
  wants mfu && part mfu_bench_model 300 experiments/bench_mfu.py --model=bench --num_widths=6 \
      --steps=10 --rounds=5
  wants widths && part widths_gpt_tiny 300 experiments/bench_widths.py --d_model=512 --heads=16 \
      --d_ff=2048 --seq_len=256 --batch=64 --num_widths=6 --repeats=10 --rounds=5 \
      --dtype=bfloat16
fi

{
  # the tables of the targets: the peer benchmark and the width kernel's block
  for md in "$OUT"/peer_*/bench_peer.md "$OUT"/widths_block_1024/bench_widths.md; do
    if [[ -f "$md" ]]; then printf '%s\n\n%s\n' "$md" "$(cat "$md")"; fi
  done
  echo "| part | result | seconds | output |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
} | tee "$OUT/summary.md"
exit "$FAILED"
