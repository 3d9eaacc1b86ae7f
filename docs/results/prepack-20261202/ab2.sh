#!/bin/bash
# old tree (de5a64a: oneDNN prepack only) vs new ($REPO HEAD: + VNNI GEMV), engine offline, alternated
source $REPO/.venv/bin/activate && export TORCH_EXTENSIONS_DIR=/tmp/tx-main
OUT=$WORK/ab2
ROUNDS=${ROUNDS:-3}
for r in $(seq 1 $ROUNDS); do
  for side in new old; do
    tree=$([ $side = new ] && echo $REPO || echo $WORK/old-tree)
    cd $tree
    for w in single "poisson --qps 4" "burst --caps 256"; do
      n=$(echo $w | cut -d' ' -f1)
      python -m serving.cli bench $w --systems engine --out $OUT/$n-$side-$r --no-progress --no-ceilings > $OUT/$n-$side-$r.log 2>&1
    done
  done
done
echo done
