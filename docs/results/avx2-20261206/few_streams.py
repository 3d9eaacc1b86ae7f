# n greedy streams decoding together (prompts of 16 tokens, 64 tokens each, EOS ignored), the default model,
# offline: output tok/s by dtype. Speculation at its default (on) and off.
import sys, time
from serving import LLM, SamplingParams
dtype, n, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "spec"
llm = LLM(dtype=dtype, num_threads=2, **({} if spec else {"num_speculative_tokens": 0}))
prompts = [f"Story number {i}: once upon a time there was a" for i in range(n)]
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
t = time.perf_counter(); outs = llm.generate(prompts, p); d = time.perf_counter() - t
print(f"{dtype} streams {n} {'spec' if spec else 'nospec'}: {sum(len(o.outputs[0].token_ids) for o in outs)/d:.1f} tok/s ({d:.2f} s)")
