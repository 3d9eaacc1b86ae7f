#!/bin/bash
# `kvrelay serve` with its defaults (direct ingress): kill -9 the replica during a stream; when does the port
# serve again? Then a client that goes away mid-stream: is its sequence aborted and are its KV blocks back?
cd "$(dirname "$0")/../../../.."; PY=$PWD/.venv/bin/python; O=${O:?out dir}; mkdir -p $O
PORT=${PORT:-8240}; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
(exec $PY -m serving.cli serve --port $PORT) > $O/kill-serve.log 2>&1 &
SP=$!
for i in $(seq 1 180); do curl -sf localhost:$PORT/health >/dev/null 2>&1 && break; sleep 1; done
ss -ltnp | grep ":$PORT " | sed 's/.*users:/listener: /'
(curl -sN localhost:$PORT/v1/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":4000,"ignore_eos":true,"stream":true}' > $O/kill-stream.txt 2>&1; echo "curl exit $?" >> $O/kill-stream.txt) &
sleep 3
RP=$(ss -ltnp | grep ":$PORT " | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2); echo "killing $RP at $(date +%T)"; kill -9 $RP
t0=$(date +%s.%N); sleep 0.5
echo "sockets on :$PORT right after: $(ss -tan | grep ":$PORT " | awk '{print $1}' | sort | uniq -c | tr '\n' ' ')"
while true; do
  code=$(curl -s -o /dev/null -w "%{http_code}" -m 3 localhost:$PORT/health)
  [ "$code" = 200 ] && { echo "health 200 after $(echo "$(date +%s.%N) - $t0" | bc | cut -c1-5) s"; break; }
  [ $(echo "$(date +%s.%N) - $t0 > 120" | bc) = 1 ] && { echo "no answer after 120 s"; break; }; sleep 0.2
done
curl -s -m 30 localhost:$PORT/v1/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":5}' | head -c 200; echo
echo "the cut stream ends: $(tail -c 120 $O/kill-stream.txt | tr '\n' ' ')"
# a client that goes away after ~1 s of a long stream
curl -sN -m 1 localhost:$PORT/v1/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":4000,"ignore_eos":true,"stream":true}' > /dev/null
sleep 2; curl -s localhost:$PORT/metrics | grep -E '^kvrelay:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|request_success_total)' | head
kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP
