# Speculation (n-gram prompt lookup, K drafts, each request's drafts as its record earns) off / on (explicitly, whatever the default), alternated:
# one stream, burst (cap 256) and poisson QPS 4 through a fresh `kvrelay serve` each, and the burst offline.
# $1 out, $2 rounds, K (default 4).
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
OUT=$1; mkdir -p $OUT; K=${K:-4}
B=".venv/bin/python -m serving.cli bench"
for r in $(seq 1 ${2:-1}); do
  for v in off on; do
    [ $v = on ] && O="--engine-option num_speculative_tokens=$K" || O="--engine-option num_speculative_tokens=0"
    $B single --systems server $O --out $OUT/single-server-$v-$r > $OUT/single-server-$v-$r.log 2>&1
    echo "single server $v $r: $(grep -E '^\| kvrelay' $OUT/single-server-$v-$r.log | head -1)"
    for sys in engine server; do
      $B burst --caps 256 --systems $sys --no-ceilings --no-progress $O --out $OUT/burst-$sys-$v-$r > $OUT/burst-$sys-$v-$r.log 2>&1
      echo "burst $sys $v $r: $(grep '| 256 |' $OUT/burst-$sys-$v-$r.log)"
    done
    $B poisson --qps 4 --systems server --no-ceilings --no-progress $O --out $OUT/poisson-server-$v-$r > $OUT/poisson-server-$v-$r.log 2>&1
    echo "poisson server $v $r: $(grep -E '^\| (4|kvrelay)' $OUT/poisson-server-$v-$r.log | head -2 | tr '\n' ' ')"
  done
done
