# A fresh `kvrelay serve`: seconds to ready, then every process's CPU over 20 s idle
# (env passes through, e.g. RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5)
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
t0=$(date +%s.%N)
.venv/bin/kvrelay serve --port 8040 > /tmp/si.log 2>&1 &
SP=$!
for i in $(seq 1 600); do sleep 0.2; grep -q "kvrelay is ready" /tmp/si.log && break; done
t1=$(date +%s.%N)
sleep 2; tot=$(bash docs/results/amx-20261203/scripts/idlecpu.sh 20 | tail -1)
kill -INT $SP; wait $SP
echo "loop=${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-default} ready $(python3 -c "print(round($t1-$t0,1))") s, idle cpu 20 s: $tot"
