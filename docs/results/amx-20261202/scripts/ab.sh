#!/bin/bash
# A/B of the AMX row limits: old (GEMV up to 128 rows everywhere) vs new (8 rows on AMX), fresh servers,
# sides alternated. Run from the repository root: bash ab.sh OUTDIR
# A names a scratch folder holding old_layer_ops.py (dee748d) and new_layer_ops.py (50461dc).
set -u
OUT=$1; A=/work/scratch/s12/amx
export TORCH_EXTENSIONS_DIR=/tmp/tx-main
for round in 1 2; do
  for side in new old; do
    cp $A/${side}_layer_ops.py kernels/layer_ops.py
    D=$OUT/$side-$round; mkdir -p $D
    echo "== $side round $round $(date +%T)"
    .venv/bin/kvrelay bench burst --caps 256 --systems engine,server --out $D --no-progress --no-ceilings 2>&1 | grep -E "^\| 256"
    .venv/bin/kvrelay bench poisson --qps 4 --systems server --out $D --no-progress --no-ceilings 2>&1 | grep -E "^\|" | head -4
  done
done
cp $A/new_layer_ops.py kernels/layer_ops.py
echo done $(date +%T)
