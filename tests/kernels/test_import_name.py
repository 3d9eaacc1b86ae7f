"""The `kernels` import name is this project's: Hugging Face's distribution of the same name is refused with
a message that says what to do, instead of a failure deep inside transformers."""

import importlib.metadata
import types

import pytest

import kernels


def test_refuses_hugging_faces_kernels_distribution(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: types.SimpleNamespace(version="0.19.1") if name == "kernels" else None)
    with pytest.raises(ImportError, match=r"`kernels` distribution 0\.19\.1.*pip uninstall kernels"):
        kernels.check_import_name_free()


def test_passes_without_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    kernels.check_import_name_free()


def test_transformers_loads_beside_this_package():
    import transformers.activations  # noqa: F401  (it imports `kernels` where Hugging Face's is installed)
    kernels.check_import_name_free()
