# Server bursts (cap 256) through fresh servers, alternating the environment "$A" and "$B" (e.g. A="X=1"), $2 rounds,
# each with the KVR_TRACE step trace (throw-away patch) summarised. $1 out.
cd "$(dirname "$0")/../../../.."; export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-ext}
OUT=$1; mkdir -p $OUT; S=docs/results/amx-20261203h/scripts
for r in $(seq 1 ${2:-1}); do
  for side in A B; do
    E=${!side}; rm -f /tmp/tr-ab-*
    env $E KVR_TRACE=/tmp/tr-ab bash $S/cpu_server_burst.sh $OUT/$side-$r > /dev/null 2>&1
    echo "$side ($E) $r: $(grep '| 256 |' $OUT/$side-$r/burst.log | cut -d'|' -f4,5)"
    python3 $S/trace_summary.py /tmp/tr-ab-* | head -1 | cut -d: -f2-
    cp /tmp/tr-ab-* $OUT/$side-$r/
  done
done
