# per-thread CPU and wakeups (voluntary+involuntary switches) of every process over a window: python wakeups.py SECS
import os, sys, time
tck = os.sysconf("SC_CLK_TCK")
def snap():
    d = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try: cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]
        except Exception: continue
        try: tids = os.listdir(f"/proc/{pid}/task")
        except Exception: continue
        for t in tids:
            try:
                st = open(f"/proc/{pid}/task/{t}/stat").read()
                name = st.split("(")[1].split(")")[0]
                f = st.rsplit(")", 1)[1].split()
                s = open(f"/proc/{pid}/task/{t}/status").read()
                v = int(s.split("\nvoluntary_ctxt_switches:")[1].split()[0]); nv = int(s.split("nonvoluntary_ctxt_switches:")[1].split()[0])
                d[(pid, t)] = (cmd or name, name, (int(f[11]) + int(f[12])) / tck, v, nv)
            except Exception: pass
    return d
a = snap(); T = float(sys.argv[1]); time.sleep(T); b = snap()
rows = []
for k, (cmd, name, c, v, nv) in b.items():
    o = a.get(k)
    if not o: continue
    dv, dn, dc = v - o[3], nv - o[4], c - o[2]
    if dv + dn > T * 2 or dc > 0.05: rows.append((dv + dn, dc, cmd, name, k[1]))
print("total wakeups/s", round(sum(r[0] for r in rows)/T), "cpu s", round(sum(r[1] for r in rows),2))
for r in sorted(rows, reverse=True)[:int(sys.argv[2]) if len(sys.argv)>2 else 40]: print(f"{r[0]/T:8.1f}/s  cpu {r[1]:6.2f}s  {r[2][:45]:45s} {r[3]:20s} {r[4]}")
