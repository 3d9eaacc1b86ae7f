# Sample every process's CPU time (and every thread of processes matching a pattern) every 0.2 s until killed.
# Output lines: monotonic_time pid tid name cpu_seconds
import os, sys, time
out = open(sys.argv[1], "w", buffering=1 << 16)
tick = os.sysconf("SC_CLK_TCK")
def stat(path):
    s = open(path).read()
    name = s[s.index("(") + 1:s.rindex(")")]
    f = s[s.rindex(")") + 2:].split()
    return name, (int(f[11]) + int(f[12])) / tick
try:
    while True:
        t = time.monotonic()
        for pid in os.listdir("/proc"):
            if not pid.isdigit(): continue
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    name, c = stat(f"/proc/{pid}/task/{tid}/stat")
                    if c > 0: out.write(f"{t:.3f} {pid} {tid} {name.replace(' ', '_')} {c:.2f}\n")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
except KeyboardInterrupt:
    out.flush()
