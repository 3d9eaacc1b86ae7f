# Steps with prompt chunks in one compiled call or through the layer loop (a throw-away KVR_NO_MIXED=1 toggle
# in CppLayerOps.mixed_layers), alternated: burst (cap 256) offline and through a fresh `kvrelay serve`, and
# poisson QPS 4 through the server. $1 out, $2 rounds.
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
OUT=$1; mkdir -p $OUT
B=".venv/bin/python -m serving.cli bench"
for r in $(seq 1 ${2:-1}); do
  for v in loop mixed; do
    [ $v = loop ] && E="KVR_NO_MIXED=1" || E="KVR_X=0"
    for sys in engine server; do
      env $E $B burst --caps 256 --systems $sys --no-ceilings --no-progress --out $OUT/burst-$sys-$v-$r > $OUT/burst-$sys-$v-$r.log 2>&1
      echo "burst $sys $v $r: $(grep '| 256 |' $OUT/burst-$sys-$v-$r.log | cut -d'|' -f3-6)"
    done
    if [ -n "$POISSON" ]; then
      env $E $B poisson --qps 4 --systems server --no-ceilings --no-progress --out $OUT/poisson-server-$v-$r > $OUT/poisson-server-$v-$r.log 2>&1
      echo "poisson server $v $r: $(grep -E '^\| (4|kvrelay)' $OUT/poisson-server-$v-$r.log | head -2 | tr '\n' ' ')"
    fi
  done
done
