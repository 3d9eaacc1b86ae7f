# A fresh `kvrelay serve` on $PORT; the CPU timeline (cpu_timeline.py) during one burst (cap 256) through --url. $1 out.
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
OUT=$1; mkdir -p $OUT; PORT=${PORT:-8050}; S=docs/results/amx-20261203h/scripts
.venv/bin/kvrelay serve --port $PORT $SERVE_ARGS > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 90); do sleep 2; grep -q "kvrelay is ready" $OUT/serve.log && break; done; sleep 3
python3 $S/cpu_timeline.py ${DUR:-26} ${DT:-0.5} > $OUT/timeline.txt &
TP=$!
.venv/bin/python -m serving.cli bench burst --caps 256 --url http://127.0.0.1:$PORT --model SmolLM2-135M-Instruct \
  --tokenizer ~/.cache/kvrelay/models/SmolLM2-135M-Instruct --no-ceilings --no-progress $BENCH_ARGS --out $OUT/burst > $OUT/burst.log 2>&1
grep '| 256 |' $OUT/burst.log
wait $TP
kill -INT $SP; wait $SP
