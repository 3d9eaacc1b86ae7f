"""Print each `kvrelay bench` JSON's runs: output tok/s, duration and median TTFT/TPOT. Argument: a glob."""
import glob
import json
import sys

for path in sorted(glob.glob(sys.argv[1])):
    for run in json.load(open(path))["runs"]:
        m = run["metrics"]
        print(f"{path}: {m['output_throughput']:.1f} tok/s in {m['duration']:.2f} s, "
              f"TTFT p50 {m['median_ttft_ms']:.0f} ms, TPOT p50 {m['median_tpot_ms']:.1f} ms")
