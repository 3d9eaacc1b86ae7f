# CPU per process in the arrival / prefill / decode windows of a burst: python cpu_windows.py TRACE CPU_SAMPLES
# (TRACE as cmp_trace.py reads it, CPU_SAMPLES from cpusample.py)
import sys, collections, bisect
trace, cpu = sys.argv[1], sys.argv[2]
st = [tuple(map(float, l.split())) for l in open(trace)]
big = [i for i, s in enumerate(st) if s[2] >= 1024]
st = st[big[0]:]
pre = [s for s in st if s[2] > s[3]]
t_start = st[0][0]; t_arr = st[0][0] + st[0][4]; t_pre = pre[-1][0] + pre[-1][4]; t_end = st[-1][0] + st[-1][4]
samples = collections.defaultdict(list)  # (pid, tid, name) -> [(t, c)]
for l in open(cpu):
    t, pid, tid, name, c = l.split()
    samples[(pid, tid, name)].append((float(t), float(c)))
def at(series, t):
    ts = [x[0] for x in series]
    i = bisect.bisect_right(ts, t) - 1
    return series[max(i, 0)][1] if i >= 0 else 0.0
wins = [("arrival", t_start, t_arr), ("prefill", t_arr, t_pre), ("decode", t_pre, t_end)]
print({w: round(b - a, 2) for w, a, b in wins})
agg = collections.defaultdict(lambda: [0.0] * 3)
for (pid, tid, name), ser in samples.items():
    for k, (w, a, b) in enumerate(wins):
        d = at(ser, b) - at(ser, a)
        if d > 0: agg[(pid, name)][k] += d
tot = [sum(v[k] for v in agg.values()) for k in range(3)]
print("total cpu-s per window:", [round(x, 2) for x in tot], "of", [round(2 * (b - a), 2) for _, a, b in wins])
for key, v in sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:25]:
    print(f"{key[0]:>7} {key[1][:28]:28s} " + " ".join(f"{x:6.2f}" for x in v))
