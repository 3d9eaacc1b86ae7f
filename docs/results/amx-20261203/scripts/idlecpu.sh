# CPU seconds per process over $1 seconds: utime+stime from /proc/PID/stat
T=${1:-20}
snap() { for p in /proc/[0-9]*; do pid=${p#/proc/}; [ -r $p/stat ] || continue; s=$(cat $p/stat 2>/dev/null) || continue; rest=${s##*) }; set -- $rest; echo "$pid $(( ${12} + ${13} )) $(tr '\0' ' ' < $p/cmdline | cut -c1-60)"; done; }
snap > /tmp/cpu_a; sleep $T; snap > /tmp/cpu_b
python3 - <<'PY'
a = {l.split()[0]: int(l.split()[1]) for l in open('/tmp/cpu_a') if len(l.split()) > 1}
tot = 0
rows = []
for l in open('/tmp/cpu_b'):
    f = l.split(maxsplit=2)
    if len(f) < 2 or f[0] not in a: continue
    d = (int(f[1]) - a[f[0]]) / 100
    tot += d
    if d > 0: rows.append((d, f[0], f[2].strip() if len(f) > 2 else ''))
for d, p, c in sorted(rows, reverse=True)[:14]: print(f"{d:6.2f} {p:>7} {c}")
print("total", round(tot, 2))
PY
