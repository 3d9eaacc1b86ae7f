"""The model runner of a tensor-parallel engine: the scheduler stays in the engine's process, and every
step goes to the rank actors (`workers/tp_worker.py`) as one message.

Each step's `StepInputs` is put in Ray's object store once and every rank's `execute` reads it from there;
the ranks run the layers in lockstep (their collectives join them) and rank 0 returns the sampled tokens.
Inside a Serve replica the ranks take the bundles of the replica's placement group, one each; elsewhere
(`LLM`) they are plain actors. A rank that dies or does not answer within `distributed_timeout_s` makes
the runner unavailable for good: the step raises `RunnerUnavailable`, every rank is killed (a survivor
may be stuck in a collective), and `check_alive` fails, so the replica reports unhealthy.

KV hand-off (P/D): a request's KV leaves and arrives in the payload layout of `workers/kv_transfer` with
all KV heads, so a tensor-parallel pool hands off to a pool of any size; the replica gathers the ranks'
head ranges on export and sends each rank its heads on import."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import torch

from workers.config import EngineConfig
from workers.models.llama import ModelArgs
from workers.model_runner import ModelRunner
from workers.model_setup import kv_blocks
from workers.sampler import SampleOutput
from workers.scheduler import SchedulerOutput
from workers.step_inputs import build_step_inputs, sampled_requests
from workers.sizing import wants_gpus
from workers.step_isolation import RunnerUnavailable
from workers.structured_output import StructuredOutputManager
from workers.tensor_parallel import TPShard
from workers.tp_worker import TPWorker

_SETUP_TIMEOUT_S = 1800.0  # loading a shard (and compiling kernels on first use) may take long


def _ensure_ray(num_ranks: int) -> None:
    """Join Ray if this process has not (a local cluster for `LLM`, with the settings of `kvrelay serve`)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False,
             configure_logging=False, num_cpus=None if os.environ.get("RAY_ADDRESS") else max(os.cpu_count() or 1, num_ranks))


class TPModelRunner:
    """The same calls as `ModelRunner` that the engine makes, served by `config.tensor_parallel_size` ranks."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config, dtype: torch.dtype,
                 max_model_len: int, structured: StructuredOutputManager | None = None) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = config.tensor_parallel_size
        args = ModelArgs.from_hf_config(hf_config)
        self.part = args.partition(TPShard(0, size))  # raises unless the model splits `size` ways
        self.kv_ranges = [args.partition(TPShard(rank, size)).kv_heads for rank in range(size)]
        self.block_size, self.timeout_s = config.block_size, config.distributed_timeout_s
        self.structured = structured  # fills the grammar bitmask here; rank 0 applies it
        self.unavailable: str | None = None  # why no step can run any more: a rank was lost
        self._released: list[str] = []
        _ensure_ray(size)
        threads = max(1, (config.num_threads or 1) // size)
        gpus = 1 if wants_gpus(config.device) else 0
        group = ray.util.get_current_placement_group()
        actor = ray.remote(TPWorker)
        tag = uuid.uuid4().hex[:8]
        self.workers = []
        for rank in range(size):
            opts = {"num_gpus": gpus, "max_concurrency": 2, "name": f"kvrelay-tp-{tag}-rank{rank}",
                    "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
            if group is not None:  # a Serve replica: rank i takes bundle i
                opts.update(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank))
            else:
                opts.update(num_cpus=0)
            self.workers.append(actor.options(**opts).remote(config, model_path, rank, size, max_model_len, threads))
        try:
            host, port = self._call_all([self.workers[0].address.remote()], _SETUP_TIMEOUT_S, settle=False)[0]
            budgets = self._call_all([w.setup.remote(host, port, self.timeout_s) for w in self.workers],
                                     _SETUP_TIMEOUT_S, settle=False)
            known = [b for b in budgets if b is not None]
            self.num_kv_blocks = kv_blocks(config, args, self.part, dtype, max_model_len, min(known) if known else None)
            devices = self._call_all([w.allocate.remote(self.num_kv_blocks) for w in self.workers], _SETUP_TIMEOUT_S,
                                     settle=False)
        except BaseException:
            self.close()
            raise
        self.device = torch.device(devices[0])
        # The cache's logical shape (all KV heads) with no memory behind it: its shards live in the ranks, and
        # KV payloads pass through this process on the CPU.
        self.kv_cache = torch.zeros((), dtype=dtype).expand(args.num_layers, 2, self.num_kv_blocks, self.block_size,
                                                            args.num_kv_heads, args.head_dim)

    def execute(self, out: SchedulerOutput) -> SampleOutput:
        import ray

        step = build_step_inputs(out, self.block_size, self.part.num_heads, self.part.num_kv_heads)
        if self.structured is not None and self.structured.active:
            step.allowed = self.structured.bitmask(sampled_requests(out))
        step.released, self._released = self._released, []
        ref = ray.put(step)
        refs = [w.execute.remote(ref) for w in self.workers]
        try:
            return self._call_all(refs, self.timeout_s)[0]
        except BaseException:
            self._released += step.released
            raise

    def _call_all(self, refs: list, timeout_s: float, settle: bool = True) -> list:
        """Every rank's result. A lost or silent rank ends the runner. A rank's error is raised once the other
        ranks have answered (`settle`: none is left inside a collective when the step is retried), or at
        once (start-up, where the ranks are killed on any error)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.unavailable is not None:
            raise RunnerUnavailable(self.unavailable)
        deadline = time.monotonic() + timeout_s
        pending, error = list(refs), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._lose(f"{len(pending)} tensor-parallel rank(s) did not answer within {timeout_s:g} s "
                           "(distributed_timeout_s)")
            try:
                ray.get(ready[0])
            except RayActorError as e:
                self._lose(f"a tensor-parallel rank died: {e}")
            except RayTaskError as e:
                error = error or e
                if not settle:
                    break
        if error is not None:
            raise error.cause if error.cause is not None else error
        return ray.get(refs)

    def _lose(self, reason: str) -> None:
        self.unavailable = reason
        self.close()
        raise RunnerUnavailable(reason)

    async def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raise `RunnerUnavailable` if a rank is lost (each answers a ping on its second thread, even
        mid-step)."""
        from ray.exceptions import RayActorError

        if self.unavailable is not None:
            raise RunnerUnavailable(self.unavailable)
        try:
            await asyncio.wait_for(asyncio.gather(*(w.ping.remote() for w in self.workers)), timeout_s)
        except RayActorError as e:
            self._lose(f"a tensor-parallel rank died: {e}")

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' grammar matchers (here) and seeded generators (on rank 0, with the
        next step)."""
        self._released += request_ids
        if self.structured is not None:
            self.structured.release(request_ids)

    check_kv_payload = ModelRunner.check_kv_payload  # against the logical (all heads) cache shape

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The request's KV in the one payload layout, all KV heads: each distinct head range comes from the
        first rank that holds it."""
        first = {}
        for rank, heads in enumerate(self.kv_ranges):
            first.setdefault(heads, rank)
        parts = self._call_all([self.workers[r].export_kv.remote(block_ids, num_tokens) for r in first.values()],
                               self.timeout_s)
        return torch.cat(parts, dim=3)

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: torch.Tensor) -> None:
        """Send every rank its KV heads of the payload (computed by any engine of the same model)."""
        self.check_kv_payload(num_tokens, payload)
        self._call_all([w.import_kv.remote(block_ids, num_tokens, payload[:, :, :, a:b].contiguous())
                        for w, (a, b) in zip(self.workers, self.kv_ranges)], self.timeout_s)

    def close(self) -> None:
        """Kill the rank actors (idempotent). Once closed, it imports nothing: `__del__` may run it again
        while the interpreter shuts down."""
        workers, self.workers = getattr(self, "workers", []), []
        if not workers:
            return
        import ray

        for w in workers:
            try:
                ray.kill(w)
            except Exception:
                pass

    def __del__(self) -> None:
        self.close()
