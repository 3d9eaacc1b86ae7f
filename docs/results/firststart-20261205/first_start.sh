#!/usr/bin/env bash
# first_start.sh TREE LABEL: a first `kvrelay serve` from TREE (no converted model, no kernel build), seconds to ready
set -u
tree=$1; label=$2
kvrelay=${KVRELAY:-$PWD/.venv/bin/kvrelay}  # the console script of the checkout it is run from
ext=/tmp/first-start-ext-$label; rm -rf $ext
mv ~/.cache/kvrelay/models ~/.cache/kvrelay/models.aside 2>/dev/null
port=$((20000 + RANDOM % 20000))
start=$(date +%s.%N)
cd $tree
TORCH_EXTENSIONS_DIR=$ext PYTHONPATH=$tree "$kvrelay" serve --port $port > /tmp/first-start-$label.log 2>&1 &
pid=$!
while ! grep -q "kvrelay is ready" /tmp/first-start-$label.log; do sleep 0.5; kill -0 $pid 2>/dev/null || break; done
end=$(date +%s.%N)
echo "$label: ready after $(echo "$end - $start" | bc) s"
kill -INT $pid; sleep 1; kill -INT $pid 2>/dev/null; wait $pid
rm -rf ~/.cache/kvrelay/models; mv ~/.cache/kvrelay/models.aside ~/.cache/kvrelay/models
ls $ext/*/ | grep -c "\.o$"
