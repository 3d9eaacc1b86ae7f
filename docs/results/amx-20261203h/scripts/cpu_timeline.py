# Every thread's CPU in intervals of $2 seconds for $1 seconds; prints per interval the CPU (in cores) of the
# engine's two busiest threads, the rest of the engine's process, Serve's proxy, and everything else.
import os, sys, time, collections
def snap():
    out = {}
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try:
            cmd = open(f'/proc/{p}/cmdline').read().replace('\0', ' ')
            for t in os.listdir(f'/proc/{p}/task'):
                r = open(f'/proc/{p}/task/{t}/stat').read().rsplit(')', 1)[1].split()
                out[(p, t)] = (int(r[11]) + int(r[12]), cmd)
        except Exception: pass
    return out
dur, dt = float(sys.argv[1]), float(sys.argv[2])
snaps = [(time.perf_counter(), snap())]
while snaps[-1][0] - snaps[0][0] < dur:
    time.sleep(dt); snaps.append((time.perf_counter(), snap()))
tot_eng = collections.Counter()
for (ta, a), (tb, b) in zip(snaps, snaps[1:]):
    d = {k: (v[0] - a[k][0]) / 100 / (tb - ta) for k, v in b.items() if k in a and v[0] > a[k][0]}
    rep = {k: v for k, v in d.items() if 'ServeReplica' in b[k][1]}
    eng = sorted(rep.values())[-2:] if rep else []
    prox = sum(v for k, v in d.items() if 'ProxyActor' in b[k][1])
    other = sum(d.values()) - sum(rep.values()) - prox
    print(f"{ta - snaps[0][0]:6.2f} engine {sum(eng):4.2f} replica-other {sum(rep.values()) - sum(eng):4.2f} proxy {prox:4.2f} other {other:4.2f}")
