# CPU seconds of every thread on the machine between two snapshots: `thread_cpu.py snap FILE` writes one,
# `thread_cpu.py diff A B` prints the threads that used the most CPU between them, grouped by process.
import json, os, sys
def snap():
    out = {}
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try:
            cmd = open(f'/proc/{p}/cmdline').read().replace('\0', ' ')[:60]
            for t in os.listdir(f'/proc/{p}/task'):
                r = open(f'/proc/{p}/task/{t}/stat').read().rsplit(')', 1)[1].split()
                comm = open(f'/proc/{p}/task/{t}/comm').read().strip()
                out[f'{p}/{t}'] = [int(r[11]) + int(r[12]), cmd, comm]
        except Exception: pass
    return out
if sys.argv[1] == 'snap':
    json.dump(snap(), open(sys.argv[2], 'w'))
else:
    a, b = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
    procs = {}
    for k, (c, cmd, comm) in b.items():
        d = (c - a.get(k, [0])[0]) / 100
        if d <= 0: continue
        procs.setdefault((k.split('/')[0], cmd), []).append((d, comm))
    tot = 0
    for (p, cmd), th in sorted(procs.items(), key=lambda x: -sum(d for d, _ in x[1])):
        s = sum(d for d, _ in th); tot += s
        if s < 0.05: continue
        th.sort(reverse=True)
        print(f"{s:6.2f} {p} {cmd}")
        print("        " + ", ".join(f"{c} {d:.2f}" for d, c in th[:8]))
    print(f"{tot:6.2f} total")
