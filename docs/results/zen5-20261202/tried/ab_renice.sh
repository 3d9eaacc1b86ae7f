#!/bin/bash
# A/B: b renices Ray's background processes (GCS, raylet, agents, log monitor, Serve controller) to 19 after start
# run from the repository root
PY=${PY:-$(pwd)/.venv/bin/python}; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
OUT=${OUT:-/tmp/kvrelay-results/renice}; mkdir -p $OUT
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
for r in $(seq 1 ${ROUNDS:-3}); do
 for side in a b; do
  $PY -m serving.cli serve --port 8012 > $OUT/serve-$side-$r.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf localhost:8012/health >/dev/null 2>&1 && break; sleep 1; done
  if [ $side = b ]; then
    for p in $(pgrep -f "gcs_server|raylet/raylet|ray/dashboard/|log_monitor.py|runtime_env|autoscaler/_private/monitor.py|ray::ServeController"); do for t in /proc/$p/task/*; do renice -n 19 -p ${t##*/} >/dev/null; done; done
  fi
  ps -eLo ni,comm | sort | uniq -c | grep -E "gcs|raylet|Serve|Proxy|python" | tr '\n' ' ' > $OUT/nice-$side-$r.txt
  for w in ${WL:-burst}; do
   args=$w; [[ $w == burst ]] && args="burst --caps 256"; [[ $w == poisson ]] && args="poisson --qps 4"
   $PY -m serving.cli bench $args --url http://localhost:8012 --model SmolLM2-135M-Instruct --tokenizer $M --no-progress --no-ceilings --out $OUT/$side-$w-$r > $OUT/bench-$side-$w-$r.log 2>&1
   echo "$r $side $w $(grep -E '^\| (burst|single|poisson|4) |^\| server at' $OUT/bench-$side-$w-$r.log | head -1 | cut -c1-90)"
  done
  kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP
  sleep 2
 done
done
