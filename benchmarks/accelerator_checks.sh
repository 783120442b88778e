#!/usr/bin/env bash
# The accelerator checks in one run, in the order docs/devices.md gives: on a GPU or NPU whose image has torch and
# transformers but no package registry. Installs this checkout without dependencies, then prints each benchmark's
# JSON lines (copied to $OUT when it is set). `--tiny` runs the same steps on CPU at tiny shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
if [ "${1:-}" = "--tiny" ]; then model=tiny; trainer=gpu_tiny; else model=0.9b; trainer=gpu; fi
site=$(mktemp -d)  # pip --target into a fresh folder: it never replaces a package already there
python -m pip install -q --no-deps --no-build-isolation --target "$site" . > "$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
export PYTHONPATH=$site PYTHONDONTWRITEBYTECODE=1
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() { local name=$1; shift; echo "== $name"; timeout "$@" 2>&1 | tee "$OUT/$name.log" | grep '^{' ; }
step copy_overlap 60 python benchmarks/copy_overlap.py --shape $model
step vs_trainer 330 python benchmarks/vs_trainer.py --shape $trainer
step accelerator_step 240 python benchmarks/accelerator_step.py --shape $model --warmup 2 --steps 5
