"""Which files of a checkpoint directory the engine may read: every one it opens (config.json, the tokenizer
files, the safetensors shards) goes through checkpoint_file, which refuses a path that leaves the directory,
by '..', an absolute path or a symlink that resolves outside it."""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath


def checkpoint_file(model_dir: Path, file: object, what: str) -> Path:
    """model_dir / file, refused (ValueError naming `what`) unless it stays inside the checkpoint: a relative
    path without '..' whose symlinks, if any, resolve inside the directory. A Hugging Face cache snapshot
    links its files into the repository's blobs/ folder, so there the repository folder is the bound. The
    file need not exist (the caller says what a missing one means)."""
    if not isinstance(file, str) or not file:
        raise ValueError(f"{what} must be a file name, got {file!r}")
    relative = PurePosixPath(file.replace("\\", "/"))
    if relative.is_absolute() or PureWindowsPath(file).drive or ".." in relative.parts:
        raise ValueError(f"{what} is {file!r}, which leaves the checkpoint directory; checkpoint files must "
                         "be paths inside it")
    root = model_dir.resolve()
    bounds = [root]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        bounds.append(root.parent.parent)
    path = model_dir / relative
    target = path.resolve()
    if not any(target.is_relative_to(bound) for bound in bounds):
        raise ValueError(f"{what} is {file!r}, a link to {target}, outside the checkpoint directory {root}")
    return path
