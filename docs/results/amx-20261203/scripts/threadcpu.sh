# per-thread CPU of the process matching $1 over $2 seconds
pid=$(pgrep -f "$1" | head -1)
snap() { for t in /proc/$pid/task/*; do s=$(cat $t/stat 2>/dev/null) || continue; r=${s##*) }; set -- $r; echo "${t##*/} $(( ${12} + ${13} )) $(cat $t/comm)"; done; }
snap > /tmp/th_a; sleep $2; snap > /tmp/th_b
python3 - <<'PY'
a = {l.split()[0]: int(l.split()[1]) for l in open('/tmp/th_a')}
rows = []
for l in open('/tmp/th_b'):
    tid, c, name = l.split(maxsplit=2)
    d = (int(c) - a.get(tid, 0)) / 100
    if d > 0: rows.append((d, tid, name.strip()))
for d, t, n in sorted(rows, reverse=True)[:12]: print(f"{d:6.2f} {t:>7} {n}")
print("total", round(sum(r[0] for r in rows), 2))
PY
