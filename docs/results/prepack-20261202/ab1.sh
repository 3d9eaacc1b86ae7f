#!/bin/bash
# prepack on/off, engine offline, alternated
cd $REPO && source .venv/bin/activate && export TORCH_EXTENSIONS_DIR=/tmp/tx-main
OUT=$WORK/ab1
for r in 1 2 3; do
  for side in on off; do
    v=$([ $side = on ] && echo true || echo false)
    kvrelay bench burst --caps 256 --systems engine --engine-option prepack_weights=$v --out $OUT/burst-$side-$r --no-progress --no-ceilings > $OUT/burst-$side-$r.log 2>&1
    kvrelay bench poisson --qps 4 --systems engine --engine-option prepack_weights=$v --out $OUT/poisson-$side-$r --no-progress --no-ceilings > $OUT/poisson-$side-$r.log 2>&1
  done
done
echo done
