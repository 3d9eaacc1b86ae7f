#!/bin/bash
# Rounds of: a fresh `kvrelay serve` per side driven by `kvrelay bench --url`, and the engine offline.
# SIDES from: proxy (default serve), di (--direct-ingress), engine. WL = single | burst | poisson. O = out dir.
cd "$(dirname "$0")/../../../.."; ROOT=$PWD; PY=$ROOT/.venv/bin/python
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
O=${O:?out dir}; mkdir -p $O
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
args=$WL; [[ $WL == burst ]] && args="burst --caps 256"; [[ $WL == poisson ]] && args="poisson --qps 4"
row() { grep -E '^\| (256|single|4|4.0|server|kvrelay|url|http) ' $1 | grep -v "^| system" | head -1; }
for r in $(seq ${FIRST:-1} ${ROUNDS:-2}); do
 for side in ${SIDES:-proxy di engine}; do
  PORT=$((8100 + r + ${PORT_BASE:-0})); [ $side = di ] && PORT=$((8150 + r + ${PORT_BASE:-0}))
  if [ $side = engine ]; then
    $PY -m serving.cli bench $args --systems engine --no-progress ${CEIL:---no-ceilings} --out $O/engine-$r > $O/engine-$r.log 2>&1
    echo "$r engine $(row $O/engine-$r.log)"
  else
    X=$SERVE_EXTRA; [ $side = di ] && X="$X --direct-ingress"; [ $side = proxy ] && X="$X --no-direct-ingress"
    (exec $PY -m serving.cli serve --port $PORT $X) > $O/serve-$side-$r.log 2>&1 &
    SP=$!
    for i in $(seq 1 180); do curl -sf localhost:$PORT/health >/dev/null 2>&1 && break; sleep 1; done; sleep 3
    $PY -m serving.cli bench $args --url http://localhost:$PORT --model SmolLM2-135M-Instruct --tokenizer $M --no-progress ${CEIL:---no-ceilings} --out $O/$side-$r > $O/$side-$r.log 2>&1
    echo "$r $side $(row $O/$side-$r.log)"
    kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP; for i in $(seq 1 60); do ss -ltn | grep -q ":$PORT " || break; sleep 1; done; sleep 2
  fi
 done
done
