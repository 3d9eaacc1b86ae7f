"""Where the compiled CPU kernels are built and how a load waits: one build folder per checkout and set of
sources (so checkouts never rebuild each other's), and a lock left by a dead process never blocks a load."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kernels import cpu_extension
from kernels.cpu_extension import SOURCES, _build_directory, load_extension

ROOT = Path(__file__).resolve().parents[2]


def test_build_folders_differ_by_checkout_and_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    here = _build_directory()
    copies = [tmp_path / "checkout" / s.name for s in SOURCES]
    copies[0].parent.mkdir()
    for source, copy in zip(SOURCES, copies):
        shutil.copy(source, copy)
    monkeypatch.setattr(cpu_extension, "SOURCES", copies)
    elsewhere = _build_directory()
    assert elsewhere != here and elsewhere == _build_directory()
    copies[0].write_text(copies[0].read_text() + "\n// changed\n")
    assert _build_directory() not in (here, elsewhere)


def test_the_same_checkout_and_torch_through_symlinks_share_one_folder(tmp_path, monkeypatch):
    """A git worktree that links the main checkout's .venv: pytest there imports torch through the link, the
    `kvrelay` console script through the interpreter its first line names; both must find one build."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    here = _build_directory()
    (tmp_path / "kernels").symlink_to(SOURCES[0].parent)
    (tmp_path / "torch").symlink_to(Path(torch.__file__).parent)
    monkeypatch.setattr(cpu_extension, "SOURCES", [tmp_path / "kernels" / s.name for s in SOURCES])
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    assert _build_directory() == here


def test_a_lock_left_by_a_dead_process_does_not_block_loading():
    load_extension()  # built (once)
    (_build_directory() / "lock").touch()  # what torch's loader leaves when its process is killed mid-build
    fresh = subprocess.run([sys.executable, "-c", "from kernels.cpu_extension import load_extension; load_extension()"],
                           cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
