# sample CPU (utime+stime ticks) of processes matching $1 every 0.5 s until they exit: "t pid ticks"
pat=$1
while true; do
  pids=$(pgrep -f "$pat")
  [ -z "$pids" ] && { sleep 0.2; n=$((n+1)); [ ${n:-0} -gt 100 ] && break; continue; }
  for p in $pids; do s=$(cat /proc/$p/stat 2>/dev/null) || continue; r=${s##*) }; set -- $r; echo "$(date +%s.%N) $p $(( ${12} + ${13} ))"; done
  sleep 0.5
  n=0; seen=1
done
