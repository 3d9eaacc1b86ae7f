import os, time, collections
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try: cmd = open(f'/proc/{pid}/cmdline').read().replace('\0',' ')[:50]
        except OSError: continue
        for tid in os.listdir(f'/proc/{pid}/task'):
            try:
                st = open(f'/proc/{pid}/task/{tid}/status').read()
                comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
            except OSError: continue
            v = int(st.split('voluntary_ctxt_switches:')[1].split()[0]); nv = int(st.split('nonvoluntary_ctxt_switches:')[1].split()[0])
            out[(pid, tid)] = (cmd, comm, v + nv)
    return out
a = snap(); time.sleep(5); b = snap()
agg = collections.Counter(); th = collections.Counter()
for k, (cmd, comm, n) in b.items():
    d = n - a.get(k, (0, 0, n))[2]
    agg[cmd] += d / 5; th[(cmd[:30], comm)] += d / 5
print('total wakeups/s', sum(agg.values()))
for k, v in agg.most_common(12): print(f'{v:8.0f} {k}')
print()
for k, v in th.most_common(25): print(f'{v:8.0f} {k}')
