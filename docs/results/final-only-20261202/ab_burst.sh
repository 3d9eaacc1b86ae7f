#!/bin/bash
# run from the repository root
HERE=$(cd $(dirname $0) && pwd)
PY=${PY:-$(pwd)/.venv/bin/python}
NEW_TREE=$(pwd)
# burst cap 256 through `kvrelay serve` (the bench starts it): the old tree and the new, alternated; the engine offline beside
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
OUT=${OUT:-${OUTDIR:-/tmp/kvrelay-results}/abb}; mkdir -p $OUT
for r in $(seq 1 ${ROUNDS:-3}); do
 for t in ${SIDES:-new old engine}; do
  d=${OLD_TREE:?a git worktree of the old commit}; sys=server; [ $t != old ] && d=$NEW_TREE; [ $t = engine ] && sys=engine
  cd $d
  echo "$r $t $(date +%T) $($PY -m serving.cli bench ${WL:-burst --caps 256} --systems $sys --no-progress --out $OUT/$t-$r 2>&1 | grep -E '^\| (burst|4|single|1) ')"
 done
done
