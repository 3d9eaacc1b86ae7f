"""One tensor-parallel rank, run as a Ray actor: it joins the ranks' torch.distributed group, loads its
shard of the weights, holds its shard of the KV cache, and runs every step it is sent. Rank 0 samples
and returns the tokens; the other ranks return None."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.config import EngineConfig
from workers.gc_heap import freeze_startup_heap
from workers.model_loader import load_hf_config, resolve_dtype, weight_files
from workers.model_setup import build_model, make_runner, profile_kv_budget
from workers.model_runner import ModelRunner
from workers.sampler import SampleOutput
from workers.sizing import resolve_device
from workers.step_inputs import StepInputs
from workers.tensor_parallel import TPShard


class TPWorker:
    def __init__(self, config: EngineConfig, model_path: str, rank: int, size: int, max_model_len: int,
                 num_threads: int) -> None:
        self.num_threads = num_threads
        torch.set_num_threads(num_threads)  # Ray's OMP_NUM_THREADS is read once; torch's own pool is set here
        self.config, self.model_path, self.max_model_len = config, model_path, max_model_len
        self.rank, self.size = rank, size
        self.device = resolve_device(config.device if config.device in ("auto", "cpu") else "cuda")
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.runner: ModelRunner | None = None

    def address(self) -> tuple[str, int]:
        """Where the group's rendezvous listens (asked of rank 0): this node's address and a free port."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, host: str, port: int, timeout_s: float) -> int | None:
        """Join the group (gloo on the CPU, NCCL on CUDA) and load this rank's shard. Returns the GPU bytes
        left for the KV cache (profiled, on CUDA) or None."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.size,
                                timeout=timedelta(seconds=timeout_s))
        tp = TPShard(self.rank, self.size, dist.group.WORLD)
        hf_config = load_hf_config(self.model_path)
        self.model, self.attn = build_model(self.config, weight_files(self.model_path), hf_config, self.dtype,
                                            self.device, self.max_model_len, tp)
        if self.device.type != "cuda":
            return None
        return profile_kv_budget(self.model, self.attn, self.config, self.dtype, self.device, self.max_model_len)

    def allocate(self, num_blocks: int) -> str:
        """Allocate this rank's KV cache shard; returns the device it lives on."""
        self.runner = make_runner(self.model, self.attn, self.config, num_blocks, self.dtype, self.device,
                                  self.max_model_len)
        freeze_startup_heap()  # the rank is built: its heap out of the collector's passes
        return str(self.device)

    def execute(self, step: StepInputs) -> SampleOutput | None:
        torch.set_num_threads(self.num_threads)  # per calling thread: the actor may run calls on its own threads
        if self.rank == 0:
            return self.runner.run(step)
        self.runner.forward(step)
        return None

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """This rank's KV heads of a request's first `num_tokens` tokens, packed, on the CPU."""
        return self.runner.export_kv(block_ids, num_tokens).cpu()

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: torch.Tensor) -> None:
        """Write this rank's KV heads of a payload into its blocks."""
        self.runner.import_kv(block_ids, num_tokens, payload)

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
