#!/bin/bash
# interleaved A/B of the decode attention kernel: engine offline, burst cap 256
# NEW: this checkout (with .venv); OLD: a git worktree of the commit before; OUT: a scratch folder
export TORCH_EXTENSIONS_DIR=/tmp/tx-main
for i in 1 2 3; do
  for side in new old; do
    if [ $side = new ]; then d=$NEW; else d=$OLD; fi
    cd $d && $NEW/.venv/bin/python -m serving.cli bench burst --caps 256 --systems engine \
      --out $OUT/$side-$i --no-progress > $OUT/$side-$i.log 2>&1
    grep -m1 'kvrelay engine (offline) |' $OUT/$side-$i.log | sed "s/^/$side $i /"
  done
done
