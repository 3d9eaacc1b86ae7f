# Summarise a py-spy raw (collapsed) profile: samples per thread, leaf and inclusive frames
# python spysum.py FILE 0 [N inclusive rows]
import sys, collections
f = sys.argv[1]; depth = int(sys.argv[2]) if len(sys.argv) > 2 else 0
threads = collections.Counter(); leaf = collections.Counter(); incl = collections.Counter()
for line in open(f):
    stack, n = line.rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    th = frames[0]
    threads[th] += n
    leaf[(th[:40], frames[-1][:110])] += n
    seen = set()
    for fr in frames[1:]:
        key = (th[:40], fr.split(" (")[0][:60])
        if key not in seen:
            seen.add(key); incl[key] += n
print("threads:"); [print(f"  {n:5d} {t[:90]}") for t, n in threads.most_common(12)]
print("leaf:"); [print(f"  {n:5d} {k[0][:25]} | {k[1]}") for k, n in leaf.most_common(25)]
print("inclusive:"); [print(f"  {n:5d} {k[0][:25]} | {k[1]}") for k, n in incl.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 40)]
