# per-process CPU seconds over a window: python cpu_sampler.py OUT SECONDS_INTERVAL (runs until killed)
import os, sys, time, json, signal
tck = os.sysconf("SC_CLK_TCK")
first, last = {}, {}
def snap():
    d = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            st = open(f"/proc/{pid}/stat").read()
            comm = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120] or st.split(")")[0].split("(")[1]
            f = st.rsplit(")", 1)[1].split()
            d[pid] = (comm, (int(f[11]) + int(f[12])) / tck)
        except Exception: pass
    return d
def dump(*_):
    out = {}
    for pid, (comm, t) in last.items():
        t0 = first.get(pid, (comm, 0.0))[1]
        if t - t0 > 0.05: out[f"{pid} {comm}"] = round(t - t0, 2)
    json.dump(dict(sorted(out.items(), key=lambda kv: -kv[1])), open(sys.argv[1], "w"), indent=1)
    sys.exit(0)
signal.signal(signal.SIGTERM, dump)
initial = True
while True:
    s = snap()
    for pid, v in s.items():
        first.setdefault(pid, v if initial else (v[0], 0.0))
    initial = False
    last.update(s)
    time.sleep(float(sys.argv[2]))
