"""glibc's heap under raised thresholds: one 50 MB tensor cloned and freed N times, the arena's size and free bytes
after (mallinfo2), the faults of each clone.    PYTHONPATH=. python malloc_fragmentation_probe.py 30
Output here: 12304 12288 12288 12288 12288 12288 12288 0 12289 0 0 ... ; end: arena 515 MiB, free 384 MiB."""
import resource, torch, sys, ctypes
libc = ctypes.CDLL("libc.so.6")
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MI
print(libc.mallopt(-1, 2**30), libc.mallopt(-3, 2**30))
def info(tag):
    m = libc.mallinfo2(); print(f"{tag}: arena {m.arena>>20} MiB mmapped {m.hblkhd>>20} MiB ({m.hblks}) free {m.fordblks>>20} top {m.keepcost>>20}")
base = torch.ones(256, 49152)
info("base")
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    copy = base.clone(); del copy
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, end=" ")
print(); info("end")
