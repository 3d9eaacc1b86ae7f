# One offline burst (cap 256): the process's user/system CPU and minor page faults during generate only.
# Optional: `thread` runs the engine on a second thread (as the server's replica does).
import sys, resource, time, threading
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
on_thread = "thread" in sys.argv[1:]
noise = [a for a in sys.argv[1:] if a.startswith("noise=")]
if noise:  # a Python thread that wakes every P ms and runs ~W us of bytecode (as an asyncio loop's timers do)
    period, work = map(float, noise[0][6:].split(","))
    def noisy():
        while True:
            time.sleep(period / 1e3)
            t = time.perf_counter()
            while time.perf_counter() - t < work / 1e6: pass
    threading.Thread(target=noisy, daemon=True).start()
def main():
    llm = LLM()
    reqs = burst_requests(llm.tokenizer, 256)
    run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
    a = resource.getrusage(resource.RUSAGE_SELF)
    results, dur = run_engine_inprocess(llm, reqs)
    b = resource.getrusage(resource.RUSAGE_SELF)
    toks = sum(r.output_tokens for r in results)
    import os
    print("threads:", sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
    print(f"{'thread' if on_thread else 'main'}: {toks / dur:.1f} tok/s, {dur:.2f} s; user {b.ru_utime - a.ru_utime:.2f} s, "
          f"system {b.ru_stime - a.ru_stime:.2f} s, minor faults {b.ru_minflt - a.ru_minflt}")
if on_thread:
    t = threading.Thread(target=main); t.start(); t.join()
else:
    main()
