import os, sys, time
pid = sys.argv[1]; tck = os.sysconf("SC_CLK_TCK")
def snap():
    d = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
            name = st.split("(")[1].split(")")[0]
            f = st.rsplit(")", 1)[1].split()
            d[t] = (name, (int(f[11]) + int(f[12])) / tck, int(open(f"/proc/{pid}/task/{t}/status").read().split("nonvoluntary_ctxt_switches:")[1].split()[0]))
        except Exception: pass
    return d
a = snap(); time.sleep(float(sys.argv[2])); b = snap()
rows = []
for t, (n, c, cs) in b.items():
    c0 = a.get(t, (n, 0.0, 0))
    if c - c0[1] > 0.05: rows.append((c - c0[1], n, t, cs - c0[2]))
for r in sorted(rows, reverse=True): print(f"{r[0]:7.2f}s  {r[1]:<20} tid {r[2]}  involuntary cs {r[3]}")
