# periodic CPU bursts like an HTTP path: python interfere.py BUSY_MS PERIOD_MS SECONDS [PROCS]
import os, sys, time
busy, period, secs = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, float(sys.argv[3])
procs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
for _ in range(procs - 1):
    if os.fork() == 0: break
end = time.monotonic() + secs
while time.monotonic() < end:
    t = time.monotonic()
    while time.monotonic() - t < busy: pass
    time.sleep(max(0.0, period - (time.monotonic() - t)))
