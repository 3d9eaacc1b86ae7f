#!/bin/bash
# rounds of: kvrelay serve + bench --url, then engine offline. WL= single|burst|poisson
PY=/work/main/.venv/bin/python; export TORCH_EXTENSIONS_DIR=/tmp/tx-main
O=${O:-/work/scratch/s11/aburl}; mkdir -p $O
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
args=$WL; [[ $WL == burst ]] && args="burst --caps 256"; [[ $WL == poisson ]] && args="poisson --qps 4"
row() { grep -E '^\| (256|single|4|4.0|server|kvrelay) ' $1 | grep -v "^| system" | head -1; }
for r in $(seq 1 ${ROUNDS:-3}); do
 for side in ${SIDES:-url engine}; do
  PORT=8012; [ $side = di ] && PORT=$((8020 + r + ${PORT_BASE:-0}))
  if [ $side = engine ]; then
    (cd /work/main && $PY -m serving.cli bench $args --systems engine --no-progress ${CEIL:---no-ceilings} --out $O/engine-$r > $O/engine-$r.log 2>&1)
    echo "$r engine $(row $O/engine-$r.log)"
  else
    X=$SERVE_EXTRA; [ $side = di ] && X="$X --direct-ingress"; (cd /work/main && exec $PY -m serving.cli serve --port $PORT $X) > $O/serve-$side-$r.log 2>&1 &
    SP=$!
    for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null 2>&1 && break; sleep 1; done; sleep 3
    if [ $side = idlebg ]; then for p in $(pgrep -f "gcs_server|raylet|ServeController|DashboardAgent|RuntimeEnvAgent|log_monitor|dashboard|serving.cli serve|monitor.py"); do chrt -a -i -p 0 $p; done; fi
    (cd /work/main && $PY -m serving.cli bench $args --url http://localhost:$PORT --model SmolLM2-135M-Instruct --tokenizer $M --no-progress ${CEIL:---no-ceilings} --out $O/$side-$r > $O/$side-$r.log 2>&1)
    echo "$r $side $(row $O/$side-$r.log)"
    kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP; for i in $(seq 1 60); do ss -ltn | grep -q ":$PORT " || break; sleep 1; done; sleep 2
  fi
 done
done
