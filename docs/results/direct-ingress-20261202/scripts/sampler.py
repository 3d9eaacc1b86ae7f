"""Every second: CPU-s per second of each Ray/bench process (threads of the replica). Prints lines."""
import os, sys, time, json
sys.path.insert(0, '/work/scratch/s11')
def stat(path):
    try: s = open(path).read()
    except OSError: return None
    f = s[s.rindex(')')+2:].split()
    return s[s.index('(')+1:s.rindex(')')], (int(f[11]) + int(f[12])) / 100.0
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        r = stat(f'/proc/{pid}/stat')
        if not r: continue
        try: cmd = open(f'/proc/{pid}/cmdline').read().replace('\0', ' ')
        except OSError: cmd = ''
        key = r[0]
        if 'ServeReplica' in cmd: key = 'replica'
        elif 'ProxyActor' in cmd: key = 'proxy'
        elif 'serving.cli bench' in cmd: key = 'client'
        elif 'ServeController' in cmd: key = 'controller'
        out[pid] = (key, r[1])
        if key == 'replica':
            for tid in os.listdir(f'/proc/{pid}/task'):
                t = stat(f'/proc/{pid}/task/{tid}/stat')
                if t: out[tid + 't'] = ('  r.' + t[0] + '.' + tid, t[1])
    return out
prev = snap(); t0 = time.time()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
DT = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
for i in range(n):
    time.sleep(DT)
    cur = snap()
    agg = {}
    for k, (name, c) in cur.items():
        d = c - prev.get(k, (name, c))[1]
        agg[name] = agg.get(name, 0) + d / DT
    prev = cur
    top = sorted(((v, k) for k, v in agg.items() if v >= 0.02), reverse=True)
    print(f'{time.time()-t0:5.1f}', ' '.join(f'{k}={v:.2f}' for v, k in top), flush=True)
