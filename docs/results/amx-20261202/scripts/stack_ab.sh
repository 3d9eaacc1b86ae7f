#!/bin/bash
# A/B of the decode stack on oneDNN's copies: old (layer loop past the GEMV's rows) vs new, fresh servers,
# sides alternated. Run from the repository root: bash stack_ab.sh OUTDIR
# S names a scratch folder holding old/ and new/ copies of the files each side puts in place
# (the three files of ba18570 and of its parent).
set -u
OUT=$1; S=/work/scratch/s12/stack
export TORCH_EXTENSIONS_DIR=/tmp/tx-main
put() { for f in csrc_decode_layers.cpp csrc_bindings.cpp layer_ops.py; do cp $S/$1/$f kernels/$f; done; }
for round in 1 2; do
  for side in new old; do
    put $side
    D=$OUT/$side-$round; mkdir -p $D
    echo "== $side round $round $(date +%T)"
    .venv/bin/kvrelay bench burst --caps 256 --systems server --out $D --no-progress --no-ceilings 2>&1 | grep -E "^\| 256"
    .venv/bin/kvrelay bench poisson --qps 4 --systems server --out $D --no-progress --no-ceilings 2>&1 | grep -E "^\| 4 "
  done
done
put old
echo done $(date +%T)
