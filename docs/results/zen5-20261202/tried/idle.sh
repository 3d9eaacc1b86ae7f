#!/bin/bash
# idle CPU of a fresh server under env "$@": idle.sh K=V ...
# run from the repository root
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvrelay-torch-ext}
env "$@" .venv/bin/python -m serving.cli serve --port 8012 > /tmp/idle-serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf localhost:8012/health >/dev/null 2>&1 && break; sleep 1; done
sleep 10
python3 - <<'PY'
import os, time
tck = os.sysconf("SC_CLK_TCK")
def snap():
    d = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            cmd = cmd.split("site-packages/ray/")[-1][:40]
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            d[pid] = (cmd, (int(f[11]) + int(f[12])) / tck)
        except Exception: pass
    return d
a = snap(); time.sleep(20); b = snap()
rows = sorted(((b[p][1] - a[p][1], b[p][0]) for p in b if p in a), reverse=True)
print("total", round(sum(r[0] for r in rows), 2), "|", " ".join(f"{cmd.strip()[:22]}={c:.2f}" for c, cmd in rows[:8]))
PY
kill -INT $SP; sleep 1; kill -INT $SP 2>/dev/null; wait $SP
