#!/bin/bash
# run from the repository root
HERE=$(cd $(dirname $0) && pwd)
PY=${PY:-$(pwd)/.venv/bin/python}
NEW_TREE=$(pwd)
# burst cap 256 against a standing fused `kvrelay serve`: per-process CPU and py-spy (threads) of the replica
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
cd ${TREE:-.}
TAG=$1; shift
D=${OUTDIR:-/tmp/kvrelay-results}/$TAG; mkdir -p $D
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
env "$@" $PY -m serving.cli serve --port 8012 > $D/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w "%{http_code}" localhost:8012/health 2>/dev/null | grep -q 200 && break; sleep 1; done
EP=$(pgrep -f "ServeReplica:kvrelay:EngineWorker" || pgrep -f "ServeReplica:kvrelay:OpenAIIngress")
$PY $HERE/cpu_sampler.py $D/cpu.json 0.5 & CP=$!
(sleep 12; $PY $HERE/threads.py $EP 20 > $D/threads.txt & [ -n "${SPY:-}" ] && py-spy record -p $EP -d 20 -r 100 --threads --nonblocking -f raw -o $D/spy.txt >/dev/null 2>&1) &
$PY -m serving.cli bench ${WL:-burst --caps 256} --url http://localhost:8012 --model SmolLM2-135M-Instruct --tokenizer $M --no-ceilings --no-progress --out $D/bench > $D/bench.log 2>&1
kill $CP; wait $CP
kill -INT $SP; sleep 1; kill -INT $SP; wait $SP
grep -E "tok/s" $D/bench.log | head -3
