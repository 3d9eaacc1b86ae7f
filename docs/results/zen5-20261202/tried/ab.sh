#!/bin/bash
# alternate old (worktree at HEAD) and new (working tree) servers; one-stream client
# ab.sh ROUNDS N_REQUESTS [WL]
# run from the repository root; OLD_TREE: a git worktree of the old commit
HERE=$(cd $(dirname $0) && pwd); REPO=$(pwd)
PY=${PY:-$REPO/.venv/bin/python}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
OUT=${OUT:-/tmp/kvrelay-results/ab}; mkdir -p $OUT
for r in $(seq 1 $1); do
 for side in old new; do
  tree=$REPO; [ $side = old ] && tree=$OLD_TREE
  (cd $tree && exec $PY -m serving.cli serve --port 8012 ${SERVE_EXTRA:-}) > $OUT/serve-$side-$r.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf localhost:8012/health >/dev/null 2>&1 && break; sleep 1; done
  sleep 3
  if [ "${WL:-client}" = client ]; then
    $PY $HERE/client.py $2 > $OUT/c-$side-$r.txt
    echo "$r $side $(awk '{s+=$5; n++} END {print s/n}' $OUT/c-$side-$r.txt) tok/s mean of $(tail -n +2 $OUT/c-$side-$r.txt | awk '{printf "%s ", $5}')"
  else
    args=$WL; [[ $WL == burst ]] && args="burst --caps 256"; [[ $WL == poisson ]] && args="poisson --qps 4"
    M=$HOME/.cache/kvrelay/models/SmolLM2-135M-Instruct
    (cd $REPO && $PY -m serving.cli bench $args --url http://localhost:8012 --model SmolLM2-135M-Instruct --tokenizer $M --no-progress --no-ceilings --out $OUT/$side-$WL-$r > $OUT/bench-$side-$WL-$r.log 2>&1)
    echo "$r $side $WL $(grep -E '^\| (4|cap 256|burst|single|poisson) ' $OUT/bench-$side-$WL-$r.log | head -1)"
  fi
  kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP
  sleep 2
 done
done
