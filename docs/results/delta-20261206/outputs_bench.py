"""OutputProcessor.process alone at batch 256: ms per step by output kind (real tokenizer, text tokens)."""
import sys, time
from transformers import AutoTokenizer
from workers.model_loader import default_model_path
from workers.output_processor import OutputKind, OutputProcessor
from workers.request import Request, RequestStatus
from workers.sampling_params import SamplingParams

tok = AutoTokenizer.from_pretrained(default_model_path())
ids = tok(open("README.md").read() + open("docs/architecture.md").read())["input_ids"]
B, STEPS, ROUNDS = 256, 96, 5

def run(kind):
    op = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(B):
        start = (i * 37) % (len(ids) - 400)
        r = Request(f"r{i}", ids[start:start + 128], params, 10**6)
        r.status = RequestStatus.RUNNING
        op.add_request(r.request_id, None, [r], kind, 0.0, False)
        reqs.append((r, ids[start + 128:start + 128 + STEPS]))
    lps = [None] * B
    sampled = [r for r, _ in reqs]
    total = 0.0
    for step in range(STEPS):
        for r, nxt in reqs:
            r.all_token_ids.append(nxt[step])
        t = time.perf_counter()
        outs, _ = op.process(sampled, lps, float(step))
        total += time.perf_counter() - t
    return 1e3 * total / STEPS, outs

for kind in sys.argv[1:] or ["delta", "final"]:
    k = OutputKind(kind)
    times = sorted(run(k)[0] for _ in range(ROUNDS))
    print(f"{kind}: {times[len(times)//2]:.3f} ms per step (rounds {', '.join(f'{t:.3f}' for t in times)})")
