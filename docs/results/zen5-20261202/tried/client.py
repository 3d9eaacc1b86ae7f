# sequential streamed completions: python client.py N [port]; prints decode tok/s per request
import sys, time, json, requests
N = int(sys.argv[1]); port = sys.argv[2] if len(sys.argv) > 2 else "8012"
prompt = list(range(1000, 1128))
for i in range(N):
    t0 = time.perf_counter(); times = []
    with requests.post(f"http://127.0.0.1:{port}/v1/completions", stream=True, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 128, "ignore_eos": True,
            "stream": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    print(f"ttft {1000*(times[0]-t0):.0f} ms decode {(len(times)-1)/(times[-1]-times[0]):.1f} tok/s chunks {len(times)}", flush=True)
