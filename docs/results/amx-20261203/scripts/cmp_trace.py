# Summarise step traces (lines: start requests tokens one-token-rows seconds; a throw-away KVR_TRACE patch
# like docs/results/amx-20261202b/scripts/step_trace.patch): prefill vs decode steps, gaps. python cmp_trace.py A B
import sys, collections
def load(f):
    rows = [l.split() for l in open(f)]
    return [(float(a), int(b), int(c), int(d), float(e)) for a, b, c, d, e in rows]
for f in sys.argv[1:]:
    st = load(f)
    # drop warm-up steps before the first big step gap
    big = [i for i, s in enumerate(st) if s[2] >= 1024]
    st = st[big[0]:] if big else st
    t0, t1 = st[0][0], st[-1][0] + st[-1][4]
    ex = sum(s[4] for s in st)
    pre = [s for s in st if s[2] > s[3]]; dec = [s for s in st if s[2] == s[3]]
    print(f"{f}: {len(st)} steps, span {t1-t0:.2f} s, execute {ex:.2f} s, gaps {t1-t0-ex:.2f} s; prefill steps {len(pre)} {sum(s[4] for s in pre):.2f} s ({sum(s[2] for s in pre)} tok); decode {len(dec)} {sum(s[4] for s in dec):.2f} s")
    b = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i, s in enumerate(dec):
        k = 8 if s[3] <= 8 else 32 if s[3] <= 32 else 64 if s[3] <= 64 else 128 if s[3] <= 128 else 256
        b[k][0] += 1; b[k][1] += s[4]
    print("   ", " ".join(f"<= {k}: {c} steps {t:.2f}s {t/c*1e3:.1f}ms" for k, (c, t, _) in sorted(b.items())))
    print("    first prefill steps (req, tok, ms):", [(s[1], s[2], round(s[4]*1e3)) for s in pre[:6]])
    # gap between steps
    gaps = [st[i+1][0] - (st[i][0] + st[i][4]) for i in range(len(st) - 1)]
    print(f"    gaps: mean {sum(gaps)/len(gaps)*1e3:.2f} ms, max {max(gaps)*1e3:.1f} ms, >5ms: {sum(1 for g in gaps if g > 0.005)}")
