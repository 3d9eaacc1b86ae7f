# Burst (cap 256): the engine offline, then a fresh `kvrelay serve`, $2 rounds, defaults unless $ARGS
# (engine options as `--engine-option k=v`). $1 out.
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
OUT=$1; mkdir -p $OUT
B=".venv/bin/python -m serving.cli bench"
for r in $(seq 1 ${2:-1}); do
  for sys in engine server; do
    $B burst --caps 256 --systems $sys --no-ceilings --no-progress $ARGS --out $OUT/burst-$sys-$r > $OUT/burst-$sys-$r.log 2>&1
    echo "burst $sys $r: $(grep '| 256 |' $OUT/burst-$sys-$r.log)"
  done
done
