# fresh server (env passed through), burst cap 256 via --url, CPU per process over the burst; $1 = out dir
cd "$(dirname "$0")/../../../.."
OUT=$1; mkdir -p $OUT
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
.venv/bin/kvrelay serve --port 8040 $SERVE_ARGS > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do sleep 2; grep -q "kvrelay is ready" $OUT/serve.log && break; done
sleep 3
[ -n "$HOOK" ] && $HOOK > $OUT/hook.txt 2>&1
bash docs/results/amx-20261203/scripts/idlecpu.sh 5 > $OUT/idle.txt
(bash docs/results/amx-20261203/scripts/idlecpu.sh 26 > $OUT/cpu.txt &)
(bash docs/results/amx-20261203/scripts/threadcpu.sh "[S]erveReplica" 26 > $OUT/threads.txt &)
(bash docs/results/amx-20261203/scripts/pidcpu.sh "[k]vrelay bench burst" > $OUT/client_cpu.txt &)
/usr/bin/time -f "client %U user %S sys %e wall" .venv/bin/kvrelay bench burst --caps 256 --url http://127.0.0.1:8040 --model SmolLM2-135M-Instruct --tokenizer ~/.cache/kvrelay/models/SmolLM2-135M-Instruct --no-ceilings --no-progress --out $OUT > $OUT/bench.log 2>&1
tail -1 $OUT/bench.log
sleep 8
kill -INT $SP; wait $SP
.venv/bin/python docs/results/amx-20261203/scripts/tput.py "$OUT/*.json"
head -8 $OUT/cpu.txt; tail -1 $OUT/cpu.txt; cat $OUT/threads.txt
