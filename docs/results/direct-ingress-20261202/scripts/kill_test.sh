#!/bin/bash
# direct ingress: kill -9 the replica during a stream; when does the port serve again?
PORT=${PORT:-8040}; PY=/work/main/.venv/bin/python; export TORCH_EXTENSIONS_DIR=/tmp/tx-main
cd /work/main && (exec $PY -m serving.cli serve --port $PORT ${X:---direct-ingress}) > /work/scratch/s11/kill-serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null 2>&1 && break; sleep 1; done
(curl -sN localhost:$PORT/v1/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":2000,"ignore_eos":true,"stream":true}' > /work/scratch/s11/kill-stream.txt 2>&1; echo "curl exit $?" >> /work/scratch/s11/kill-stream.txt) &
sleep 3
RP=$(pgrep -f "ServeReplica" | head -1); echo "killing $RP at $(date +%T)"; kill -9 $RP
t0=$(date +%s)
for i in $(seq 1 90); do
  code=$(curl -s -o /dev/null -w "%{http_code}" -m 3 localhost:$PORT/health); echo "$(( $(date +%s) - t0 ))s health=$code"
  [ "$code" = 200 ] && break; sleep 2
done
curl -s -m 30 localhost:$PORT/v1/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":5}' | head -c 300; echo
tail -c 300 /work/scratch/s11/kill-stream.txt
kill -INT $SP; sleep 1; kill -INT $SP; wait $SP
