"""Per-thread schedstat of the replica over N seconds: run, runqueue wait, sleep; ctx switches."""
import os, sys, time
pid = [p for p in os.listdir('/proc') if p.isdigit() and 'ServeReplica' in open(f'/proc/{p}/cmdline').read()][0]
def snap():
    out = {}
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            run, wait, sl = map(int, open(f'/proc/{pid}/task/{tid}/schedstat').read().split())
            st = open(f'/proc/{pid}/task/{tid}/status').read()
            v = int(st.split('voluntary_ctxt_switches:')[1].split()[0]); nv = int(st.split('nonvoluntary_ctxt_switches:')[1].split()[0])
            name = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
        except OSError: continue
        out[tid] = (name, run, wait, v, nv)
    return out
time.sleep(float(sys.argv[1])); a = snap(); t = float(sys.argv[2]); time.sleep(t); b = snap()
for tid, (n, r, w, v, nv) in b.items():
    if tid not in a: continue
    dr = (r - a[tid][1]) / 1e9 / t; dw = (w - a[tid][2]) / 1e9 / t
    if dr > 0.02: print(f'{tid} {n:16s} run {dr:.3f} rq-wait {dw:.3f} sleep {1-dr-dw:.3f}  vol/s {(v-a[tid][3])/t:.0f} invol/s {(nv-a[tid][4])/t:.0f}')
