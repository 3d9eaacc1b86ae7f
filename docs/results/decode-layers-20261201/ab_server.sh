#!/bin/bash
# NEW: this checkout (with .venv); OLD: a git worktree of 2c30833; OUT: a scratch folder
export TORCH_EXTENSIONS_DIR=/tmp/tx-main
for i in 1 2; do
  for side in new old; do
    if [ $side = new ]; then d=$NEW; else d=$OLD; fi
    cd $d && $NEW/.venv/bin/python -m serving.cli bench single --systems server --no-progress --no-ceilings --out $OUT/srv-$side-$i > $OUT/srv-$side-$i.log 2>&1
    echo "$side $i $(grep -m1 'kvrelay serve (HTTP) |' $OUT/srv-$side-$i.log)"
  done
done
