"""Triton's interpreter, patched once per launch. Under TRITON_INTERPRET=1 a launch points triton.language's
builtins at the interpreter (`_patch_lang`: inspect.getmembers over the language modules) and restores them
when its grid is done; but every call of a @triton.jit helper inside the kernel patches them again, although
nothing restored them in between. On this suite's kernels that re-patching is about half of an interpreted
launch's time. Here a helper call patches only what its launch has not patched yet (the language modules its
own module sees: triton's standard library reaches builtins through triton.language.core, the kernels through
triton.language), so a launch computes exactly what it computed before, sooner."""

import inspect

_NOT_LAUNCHING = None


def patch_language_once_per_launch() -> bool:
    """Wraps the interpreter's launch (GridExecutor.__call__) and `_patch_lang` as the module docstring says
    (read against triton 3.8's interpreter); False (nothing changed) where triton is missing or its
    interpreter lacks either."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if patch_lang is None or launch is None or getattr(patch_lang, "once_per_launch", False):
        return False
    patched = [_NOT_LAUNCHING]  # inside a launch: the sets of language modules it has patched

    seen: dict[int, tuple[int, frozenset[int]]] = {}  # id(globals) -> (their count, the languages)

    def languages_of(fn) -> frozenset[int]:
        """The modules upstream patches for fn: those of its globals that are triton.language or its core
        (looked up again when the globals grow, as the interpreter's first rewrite of a function does)."""
        names = fn.__globals__
        count, languages = seen.get(id(names), (-1, frozenset()))
        if count != len(names):
            languages = frozenset(id(value) for value in names.values()
                                  if inspect.ismodule(value) and value in (tl, tl.core))
            seen[id(names)] = len(names), languages
        return languages

    def launch_once(self, *args, **kwargs):
        outer, patched[0] = patched[0], set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched[0] = outer

    def once_per_launch(fn):
        if patched[0] is _NOT_LAUNCHING:
            return patch_lang(fn)
        languages = languages_of(fn)
        if languages in patched[0]:
            return None  # a helper's call, after the launch patched these modules: upstream drops its scope
        patched[0].add(languages)
        return patch_lang(fn)

    once_per_launch.once_per_launch = True
    interpreter._patch_lang = once_per_launch
    interpreter.GridExecutor.__call__ = launch_once
    return True
