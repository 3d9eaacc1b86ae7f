#!/bin/bash
# A/B: kvrelay serve with the engine in the ingress (fused) vs in its own replica (split); fresh server per run.
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=${OUT:-/tmp/engine-in-ingress-ab}; mkdir -p $OUT
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
PY=.venv/bin/python

ROUNDS=${ROUNDS:-2}; WORKLOADS=${WORKLOADS:-single,burst}
for r in $(seq 1 $ROUNDS); do
 for mode in ${MODES:-fused split}; do
  flag=--engine-in-ingress; [[ $mode == split ]] && flag=--no-engine-in-ingress
  for w in ${WORKLOADS//,/ }; do
   args=$w; [[ $w == burst ]] && args="burst --caps 256"; [[ $w == poisson ]] && args="poisson --qps 4"
   $PY -m serving.cli serve $flag --port 8012 ${SERVE_EXTRA:-} > $OUT/serve-$mode-$w-$r.log 2>&1 &
   for i in $(seq 1 120); do curl -sf http://127.0.0.1:8012/health >/dev/null && break; sleep 2; done
   echo "== round $r $mode $w $(date +%T)"
   timeout 900 $PY -m serving.cli bench $args --url http://127.0.0.1:8012 --model SmolLM2-135M-Instruct --tokenizer $M \
      --out $OUT/$mode-$w-$r --no-progress 2>&1 | grep -E "tok/s|TTFT|TPOT|roofline|decode" | head -12
   pkill -INT -f "serving.cli serve $flag --port 8012"; for i in $(seq 1 60); do pgrep -f "serving.cli serve" >/dev/null || break; sleep 1; done
   pkill -9 -f "serving.cli serve" ; sleep 2
  done
 done
done
