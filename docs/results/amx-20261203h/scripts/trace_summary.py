# Summary of a KVR_TRACE step trace (throw-away patch in Engine.step; columns: schedule start, execute start,
# execute end, step end, requests, tokens, one-token rows). Usage: trace_summary.py FILE [FILE...]
import sys
for f in sys.argv[1:]:
    st = [list(map(float, l.split())) for l in open(f)]
    if not st: continue
    span = st[-1][3] - st[0][0]
    ex = sum(s[2] - s[1] for s in st); sc = sum(s[1] - s[0] for s in st); po = sum(s[3] - s[2] for s in st)
    gaps = [b[0] - a[3] for a, b in zip(st, st[1:])]
    pre = [s for s in st if s[5] > s[4] * 5]
    dec = [s for s in st if s[5] <= s[4] * 5]
    print(f"{f}: {len(st)} steps, span {span:.2f} s; execute {ex:.2f} (prefill {sum(s[2]-s[1] for s in pre):.2f} in {len(pre)}, "
          f"decode {sum(s[2]-s[1] for s in dec):.2f} in {len(dec)}); schedule {sc:.2f}; outputs {po:.2f}; between steps {sum(gaps):.2f} (max {max(gaps or [0])*1e3:.0f} ms)")
    for lo, hi in ((1, 8), (9, 64), (65, 128), (129, 256)):
        b = [s for s in dec if lo <= s[4] <= hi]
        if b: print(f"   decode {lo}-{hi} requests: {len(b)} steps, execute {1e3*sum(s[2]-s[1] for s in b)/len(b):.1f} ms, "
                    f"rows {sum(s[5] for s in b)/len(b):.0f}, schedule+outputs {1e3*sum(s[1]-s[0]+s[3]-s[2] for s in b)/len(b):.1f} ms, gap {1e3*sum(g for g, s in zip(gaps, st[1:]) if s in b)/len(b):.1f} ms")
