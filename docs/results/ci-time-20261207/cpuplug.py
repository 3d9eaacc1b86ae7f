import time, json, os
_out = open(os.environ.get("CPUPLUG_OUT", "/tmp/cpuplug.jsonl"), "a")
def _busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v) - idle) / os.sysconf("SC_CLK_TCK"), sum(v) / os.sysconf("SC_CLK_TCK")
_start = {}
def pytest_runtest_logstart(nodeid, location):
    _start[nodeid] = (time.time(), _busy())
def pytest_runtest_logfinish(nodeid, location):
    t0, (b0, a0) = _start.pop(nodeid)
    b1, a1 = _busy()
    _out.write(json.dumps({"id": nodeid, "wall": time.time() - t0, "busy": b1 - b0, "all": a1 - a0}) + "\n"); _out.flush()
