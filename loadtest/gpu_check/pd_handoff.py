"""The prefill/decode hand-off across two processes on one device over the cuda_ipc transport (shared memory
on the CPU): process A prefills and offers the prompt's KV, process B fetches it and decodes from it; B's
tokens must equal one engine's doing both."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

from loadtest.gpu_check.engines import generate, greedy, make_engine, random_prompts, release_memory
from loadtest.gpu_check.plan import Plan
from workers.engine import KVImport
from workers.output_processor import OutputKind

TIMEOUT_S = 120
DTYPE = "float32"


def transport_available() -> str | None:
    """None when the cuda_ipc transport imports, else why not."""
    try:
        import workers.kv_transfer.cuda_ipc  # noqa: F401
    except ImportError as e:
        return f"cuda_ipc transport not available ({e})"
    return None


def _prefill(plan: Plan, model: str, prompt: list[int], tickets, done) -> None:
    """Process A: prefill with `hold_kv`, offer the KV, keep it until B says it is done."""
    try:
        from workers.kv_transfer.cuda_ipc import CudaIpcSender
        from workers.kv_transfer.layout import KVLayout, KVTransferMeta

        engine = make_engine(plan, model, DTYPE, plan.device, "triton", False, max_num_seqs=8)
        engine.add_request("pd", None, greedy(1), prompt_token_ids=prompt, output_kind=OutputKind.FINAL_ONLY,
                           hold_kv=True)
        first: list[int] = []
        while engine.has_unfinished_requests():
            first += [t for out in engine.step() if out.finished for t in out.outputs[0].token_ids]
        payload = engine.export_kv("pd")
        sender = CudaIpcSender()
        meta = KVTransferMeta("pd", payload.shape[2], KVLayout.of(engine.runner.kv_cache, model), sender.transport,
                              payload.nbytes)
        tickets.put({"ticket": sender.offer("pd", payload, meta), "first": first, "num_tokens": payload.shape[2]})
        done.wait(TIMEOUT_S)
        sender.close()
        engine.release_kv("pd")
    except Exception:
        tickets.put({"error": traceback.format_exc()[-3000:]})


def _decode(plan: Plan, model: str, prompt: list[int], tickets, results, done) -> None:
    """Process B: fetch the KV and decode the rest from prompt + first token."""
    try:
        from workers.kv_transfer.cuda_ipc import CudaIpcReceiver

        engine = make_engine(plan, model, DTYPE, plan.device, "triton", False, max_num_seqs=8)
        offer = tickets.get(timeout=TIMEOUT_S)
        if "error" in offer:
            results.put({"error": "prefill process failed:\n" + offer["error"]})
            return
        payload = CudaIpcReceiver(engine.device).fetch(offer["ticket"])
        done.set()
        ids = prompt + offer["first"]
        engine.add_request("pd", None, greedy(plan.pd_tokens - 1), prompt_token_ids=ids,
                           output_kind=OutputKind.FINAL_ONLY, kv_import=KVImport(offer["num_tokens"], payload))
        rest: list[int] = []
        while engine.has_unfinished_requests():
            rest += [t for out in engine.step() if out.finished for t in out.outputs[0].token_ids]
        stats = engine.get_stats()
        results.put({"tokens": offer["first"] + rest, "kv_tokens": offer["num_tokens"],
                     "payload_bytes": payload.nbytes, "import_fallbacks": stats.num_kv_import_fallbacks})
    except Exception:
        results.put({"error": traceback.format_exc()[-3000:]})
    finally:
        done.set()


def check_pd(plan: Plan, model: str, vocab: int) -> dict:
    prompt = random_prompts(1, plan.pd_prompt_len, vocab, seed=5)[0]
    ctx = mp.get_context("spawn")
    tickets, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_prefill, args=(plan, model, prompt, tickets, done)),
             ctx.Process(target=_decode, args=(plan, model, prompt, tickets, results, done))]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=TIMEOUT_S)
    except queue.Empty:
        got = {"error": f"no result from the decode process within {TIMEOUT_S} s"}
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    if "error" in got:
        return {"passed": False, "error": got["error"]}
    engine = make_engine(plan, model, DTYPE, plan.device, "triton", False, max_num_seqs=8)
    expected = generate(engine, [prompt], greedy(plan.pd_tokens))[0]
    del engine
    release_memory()
    return {"passed": got["tokens"] == expected and got["import_fallbacks"] == 0, "transport": "cuda_ipc",
            "dtype": DTYPE, "prompt_len": len(prompt), "tokens": got["tokens"], "colocated_tokens": expected,
            "kv_tokens": got["kv_tokens"], "payload_bytes": got["payload_bytes"],
            "import_fallbacks": got["import_fallbacks"]}
