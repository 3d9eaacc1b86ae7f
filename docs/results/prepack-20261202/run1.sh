#!/bin/bash
source .venv/bin/activate && export TORCH_EXTENSIONS_DIR=/tmp/tx-main
OUT=${OUT:?set OUT}
for w in single "burst --caps 256" "poisson --qps 4"; do
  for s in server engine; do
    n=$(echo $w | cut -d' ' -f1)
    kvrelay bench $w --systems $s --out $OUT/$s-$n --no-progress > $OUT/$s-$n.log 2>&1
    pkill -INT -f "serving.cli serve"; pkill -INT -f "kvrelay serve"; sleep 2
  done
done
echo done
