#!/bin/bash
# run from the repository root
HERE=$(cd $(dirname $0) && pwd)
PY=${PY:-$(pwd)/.venv/bin/python}
NEW_TREE=$(pwd)
# A/B of an environment setting on a standing `kvrelay serve` (fresh server per run), alternated:
# ENV_B="K=V ..." WL="single" ROUNDS=2 ab_env.sh TAG
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
cd ${TREE:-.}
TAG=$1; OUT=${OUTDIR:-/tmp/kvrelay-results}/$TAG; mkdir -p $OUT
M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
for r in $(seq 1 ${ROUNDS:-2}); do
 for side in a b; do
  envs=${ENV_A:-}; [ $side = b ] && envs=$ENV_B
  env $envs $PY -m serving.cli serve --port 8012 ${SERVE_EXTRA:-} > $OUT/serve-$side-$r.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf localhost:8012/health >/dev/null 2>&1 && break; sleep 1; done
  for w in ${WL:-single}; do
   args=$w; [[ $w == burst ]] && args="burst --caps 256"; [[ $w == poisson ]] && args="poisson --qps 4"
   $PY -m serving.cli bench $args --url http://localhost:8012 --model SmolLM2-135M-Instruct --tokenizer $M --no-progress --out $OUT/$side-$w-$r > $OUT/bench-$side-$w-$r.log 2>&1
   echo "$r $side $w $(date +%T) $(grep -E '^\| (1|4|256|single) ' $OUT/bench-$side-$w-$r.log | head -1)"
  done
  kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP
  sleep 2
 done
done
