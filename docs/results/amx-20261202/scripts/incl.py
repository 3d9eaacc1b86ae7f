import sys, collections
keys = sys.argv[2].split(",")
tot = 0; c = collections.Counter(); steps = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" "); n = int(n)
    if "step (" not in stack and "_step" not in stack: continue
    tot += n
    frames = stack.split(";")
    for f in reversed(frames):
        hit = next((k for k in keys if k in f), None)
        if hit: c[hit] += n; break
    else: c["other"] += n
print("samples in engine steps", tot)
for k, n in c.most_common(): print(f"{100*n/tot:5.1f}% {k}")
