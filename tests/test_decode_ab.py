"""benchmarks/decode_ab.py's versions: a git commit-ish becomes a temporary worktree of that commit, removed
afterwards; a directory is used as it is. (The timed passes themselves need CUDA.)"""

import subprocess
from contextlib import ExitStack

import pytest

from benchmarks.decode_ab import git_worktree, resolve_tree
from tests.conftest import ROOT

needs_git = pytest.mark.skipif(subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                              capture_output=True).returncode != 0,
                               reason="a copy of the tree without its git history")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@needs_git
def test_a_commit_is_checked_out_into_a_worktree_that_is_removed_afterwards():
    with git_worktree("HEAD") as tree:
        assert (tree / "engine.py").read_text() == git("show", "HEAD:engine.py")
        assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                              text=True).stdout == git("rev-parse", "HEAD")
        assert str(tree) in git("worktree", "list")
    assert not tree.exists()
    assert str(tree) not in git("worktree", "list")


@needs_git
def test_a_name_that_is_neither_a_directory_nor_a_commit_is_refused_by_name():
    with ExitStack() as stack, pytest.raises(ValueError, match="'no-such-ref-41' is neither a directory"):
        resolve_tree("no-such-ref-41", stack)


def test_a_directory_is_used_as_it_is(tmp_path):
    with ExitStack() as stack:
        assert resolve_tree(str(tmp_path), stack) == tmp_path.resolve()
