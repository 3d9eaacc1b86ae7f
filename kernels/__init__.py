"""Attention over the paged KV cache. One interface, backends chosen by name at run time."""

import importlib.metadata


def check_import_name_free() -> None:
    """Hugging Face's `kernels` distribution installs a top-level module of this package's name; with both
    in one environment whichever comes first on `sys.path` shadows the other (transformers 5.25 and later
    import it on load and then fail inside `transformers.activations`). Say so plainly instead."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"the `kernels` distribution {dist.version} (Hugging Face's, required by transformers 5.25 and later) is "
        "installed beside kvrelay, whose `kernels` package has the same import name; uninstall it "
        "(`pip uninstall kernels`) and keep transformers below 5.25, as kvrelay's pyproject.toml pins")


check_import_name_free()


from kernels.attention import (AttentionBackend, AttentionMetadata, CommonAttentionMetadata, available_backends,
                               get_attention_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "available_backends",
           "get_attention_backend"]
